"""The chunked DCT of DCT momentum (:func:`diloco_jax.algorithm.exchange.dct_momentum`).

A float32 vector is cut into chunks ``x_NxS`` of ``S`` values; each chunk is transformed by the
orthonormal DCT-II ``C_NxS = x_NxS @ D_SxS.T`` (so ``x = C @ D``: the inverse is the transpose).
Of each chunk's ``S`` coefficients the ``K`` largest in magnitude travel, as float32 values and
their positions (``uint8`` for ``S <= 256``); what is not sent stays in the local momentum.
DeMo (Peng et al., arXiv 2411.19870) uses 2-D chunks of weight matrices; we use 1-D chunks of the
flattened parameters, which needs no shapes and treats every leaf alike.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from diloco_jax.algorithm import compress
from diloco_jax.algorithm.options import require


class DctConfig(NamedTuple):
    """``chunk``: values per DCT chunk (S); ``topk``: coefficients sent per chunk (K);
    ``beta``: momentum decay of the local accumulator; ``min_size``: leaves with fewer values
    are averaged in float32."""

    chunk: int = 64
    topk: int = 4
    beta: float = 0.9
    min_size: int = 4096


def validate(config: DctConfig) -> None:
    """Raises :class:`~diloco_jax.algorithm.options.OptionError` for a field out of range."""
    require(config.chunk >= 2, "dct.chunk", config.chunk, "must be an integer >= 2")
    require(1 <= config.topk <= config.chunk, "dct.topk", config.topk,
            f"must be in [1, {{dct.chunk}} = {config.chunk}]")  # fmt: skip
    require(0 <= config.beta <= 1, "dct.beta", config.beta, "must be in [0, 1]")
    require(config.min_size >= 0, "dct.min_size", config.min_size, "must be >= 0")


def matrix(size: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``D_SxS``: ``D[k, n] = c_k cos(pi (n + 1/2) k / S)``,
    ``c_0 = sqrt(1/S)``, ``c_k = sqrt(2/S)``."""
    n = np.arange(size)
    d = np.cos(np.pi * (n[None, :] + 0.5) * n[:, None] / size) * np.sqrt(2.0 / size)
    d[0] /= np.sqrt(2.0)
    return d.astype(np.float32)


def padded(size: int, chunk: int) -> int:
    return -(-size // chunk) * chunk


def position_dtype(chunk: int):
    return jnp.uint8 if chunk <= 256 else jnp.uint16 if chunk <= 65536 else jnp.int32


def extract(flat: jax.Array, chunk: int, topk: int):
    """``(vals_NxK, idx_NxK, kept)``: each chunk's ``topk`` largest DCT coefficients, their
    positions, and ``flat`` minus their inverse DCT (what stays local)."""
    d_SxS = jnp.asarray(matrix(chunk))
    x_NxS = flat.reshape(-1, chunk)
    c_NxS = jnp.dot(x_NxS, d_SxS.T, precision=lax.Precision.HIGHEST)
    _, idx_NxK = lax.top_k(jnp.abs(c_NxS), topk)
    vals_NxK = jnp.take_along_axis(c_NxS, idx_NxK, axis=1)
    sent_NxS = _scatter(vals_NxK, idx_NxK, chunk)
    return vals_NxK, idx_NxK.astype(position_dtype(chunk)), _inverse(c_NxS - sent_NxS)


def _scatter(vals_NxK: jax.Array, idx_NxK: jax.Array, chunk: int, into=None) -> jax.Array:
    """``into`` (or zeros ``[N, S]``) plus ``vals`` at (row, ``idx``): positions are distinct
    within a row (one message's top-k), so no index repeats and the scatter is deterministic."""
    rows_Nx1 = jnp.arange(vals_NxK.shape[0])[:, None]
    into = jnp.zeros((vals_NxK.shape[0], chunk), jnp.float32) if into is None else into
    return into.at[rows_Nx1, idx_NxK.astype(jnp.int32)].add(vals_NxK, unique_indices=True)


def decode(vals_NxK: jax.Array, idx_NxK: jax.Array, chunk: int) -> jax.Array:
    """The flat float32 vector whose chunks have the DCT coefficients ``vals`` at ``idx`` (one
    message)."""
    return _inverse(_scatter(vals_NxK, idx_NxK, chunk))


def decode_sum(vals_RxNxK: jax.Array, idx_RxNxK: jax.Array, chunk: int) -> jax.Array:
    """The sum of ``R`` messages: ``x = (sum_r C_r) @ D`` where ``C_r`` holds message ``r``'s
    coefficients; the ``C_r`` are added into one float32 ``[N, S]`` in the order ``r = 0, 1,
    ...`` (never a scatter of several messages' positions at once, which may repeat)."""

    def add(r, c_NxS):
        return _scatter(vals_RxNxK[r], idx_RxNxK[r], chunk, c_NxS)

    c_NxS = jnp.zeros((vals_RxNxK.shape[1], chunk), jnp.float32)
    return _inverse(compress.fold(add, vals_RxNxK.shape[0], c_NxS))


def _inverse(c_NxS: jax.Array) -> jax.Array:
    d_SxS = jnp.asarray(matrix(c_NxS.shape[1]))
    return jnp.dot(c_NxS, d_SxS, precision=lax.Precision.HIGHEST).reshape(-1)


def message_bytes(num_values: int, config: DctConfig) -> int:
    """Bytes one replica's message takes: ``K`` float32 values and positions per chunk."""
    chunks = padded(num_values, config.chunk) // config.chunk
    return chunks * config.topk * (4 + np.dtype(position_dtype(config.chunk)).itemsize)
