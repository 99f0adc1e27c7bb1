"""A text corpus as byte-level tokens, split by position, sampled per replica.

Tokens are the UTF-8 bytes of the text (vocabulary 256; no tokenizer files). The last
``val_fraction`` of the bytes is the validation split. The training split is cut into ``R``
contiguous, disjoint shards, one per replica (:func:`replica_shards`); a device holds only the
shards of its replicas. The windows a replica trains on at a step are a pure function of
``(seed, replica, step)`` (:func:`sample_batch`), computed on device inside the compiled step, so
a resumed or re-sharded run sees the same data.
"""

from __future__ import annotations

import gzip
import lzma
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.base.randomness import replica_key

SHAKESPEARE = "shakespeare"
SHIPPED = {SHAKESPEARE: pathlib.Path(__file__).with_name("shakespeare.txt.xz")}
VOCAB_SIZE = 256


class DataError(ValueError):
    """A data file is missing, unreadable or unusable."""


class Corpus(NamedTuple):
    """Tokens of a corpus, split into training and validation.

    Attributes:
      train_N: ``[N]`` tokens of the training split (uint8 bytes, or a wider integer type).
      val_M: ``[M]`` tokens of the validation split.
      source: where the text came from (path).
      vocab_size: the tokenizer's vocabulary (256 for bytes).
      tokenizer: encodes and decodes text (:mod:`diloco_jax.data.tokenizer`); None: bytes.
    """

    train_N: np.ndarray
    val_M: np.ndarray
    source: str
    vocab_size: int = VOCAB_SIZE
    tokenizer: Any = None


def read_bytes(path: pathlib.Path) -> bytes:
    """The file's bytes, decompressed for ``.xz`` and ``.gz``. A compressed file of at most
    :data:`KEEP_DECOMPRESSED` bytes is decompressed once per process while it is unchanged (the
    shipped corpus takes 0.14 s to decompress; a sweep or a test session reads it for each run)."""
    opener: Any = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix, open)
    try:
        if opener is open:
            return path.read_bytes()
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        if key in _decompressed:
            return _decompressed[key]
        with opener(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except (OSError, lzma.LZMAError, EOFError) as e:
        raise DataError(f"cannot read data file {path}: {e}") from None
    if len(data) <= KEEP_DECOMPRESSED:
        _decompressed.clear()  # the last one only
        _decompressed[key] = data
    return data


KEEP_DECOMPRESSED = 32 * 2**20
_decompressed: dict[tuple[str, int, int], bytes] = {}


def check_budget(size: int, max_bytes: int, source, kind: str) -> None:
    if max_bytes and size > max_bytes:
        raise DataError(
            f"{source} holds {size:,} bytes of tokens, more than data.max_memory_mib allows "
            f"({max_bytes:,} bytes), and {kind} cannot be streamed: use an uncompressed text file"
        )


def shard_bounds(num_train: int, replicas: int, seq_len: int) -> int:
    """Length of each replica's contiguous shard of the training split.

    Replica ``r`` owns ``train[r * shard_len : (r + 1) * shard_len]``. Raises if a shard cannot
    hold one window of ``seq_len + 1`` tokens.
    """
    shard_len = num_train // replicas
    if shard_len < seq_len + 1:
        raise DataError(
            f"training split of {num_train} tokens is too small for {replicas} replica shards "
            f"of at least seq_len + 1 = {seq_len + 1} tokens"
        )
    return shard_len


def replica_shards(train_N: np.ndarray, replicas: int, seq_len: int) -> np.ndarray:
    """The training split cut into ``replicas`` contiguous, disjoint shards ``[R, S]`` (a view,
    no copy; the last ``N mod R`` tokens are unused). Raises :class:`DataError` if a shard cannot
    hold one window of ``seq_len + 1`` tokens."""
    shard_len = shard_bounds(len(train_N), replicas, seq_len)
    return train_N[: replicas * shard_len].reshape(replicas, shard_len)


def window_starts(*, seed, replica, step, batch_size: int, shard_len: int, seq_len: int):
    """int32 ``[batch_size]``: where the windows of ``replica`` at ``step`` start in its shard of
    ``shard_len`` tokens, uniform, from ``fold_in(fold_in(key(seed), step), replica)``. The
    same on every backend: the streamed loader computes them on the host."""
    key = replica_key(seed, step, replica)
    return jax.random.randint(key, (batch_size,), 0, shard_len - seq_len, dtype=jnp.int32)


def sample_batch(
    shard_S: jax.Array,
    *,
    seed: int | jax.Array,
    replica: jax.Array,
    step: jax.Array,
    batch_size: int,
    seq_len: int,
) -> jax.Array:
    """The ``batch_size`` windows of ``seq_len + 1`` tokens that ``replica`` trains on at ``step``,
    from its own shard ``shard_S`` (a row of :func:`replica_shards`).

    Window starts are uniform over the shard, drawn from ``fold_in(fold_in(key(seed), step),
    replica)``. Returns int32 ``tokens_BxL1`` (inputs are ``[:, :-1]``, targets ``[:, 1:]``).
    """
    starts_B = window_starts(seed=seed, replica=replica, step=step, batch_size=batch_size,
                             shard_len=shard_S.shape[-1], seq_len=seq_len)  # fmt: skip
    idx_BxL1 = starts_B[:, None] + jnp.arange(seq_len + 1, dtype=jnp.int32)[None, :]
    return shard_S[idx_BxL1].astype(jnp.int32)


def eval_windows(val_M: np.ndarray, *, seq_len: int, max_windows: int) -> np.ndarray:
    """Up to ``max_windows`` non-overlapping windows ``[W, seq_len + 1]`` spread evenly over the
    validation split (all of them when ``max_windows <= 0``)."""
    total = (len(val_M) - 1) // seq_len
    if total < 1:
        raise DataError(
            f"validation split of {len(val_M)} tokens is shorter than one window of "
            f"seq_len + 1 = {seq_len + 1} tokens"
        )
    count = total if max_windows <= 0 else min(total, max_windows)
    picks = np.floor(np.arange(count) * (total / count)).astype(np.int64)
    starts = picks * seq_len
    return np.stack([val_M[s : s + seq_len + 1] for s in starts]).astype(np.int32)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token distribution of ``tokens`` (a no-context baseline loss)."""
    counts = np.bincount(tokens).astype(np.float64)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum())
