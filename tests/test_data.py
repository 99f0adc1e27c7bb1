"""The corpus: loading, errors, disjoint per-replica shards, deterministic sampling."""

import lzma

import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax.data import (
    DataError,
    eval_windows,
    load_corpus,
    replica_shards,
    sample_batch,
    shard_bounds,
)
from diloco_jax.data.corpus import unigram_entropy


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("shakespeare", val_fraction=0.05)


def test_shipped_corpus(corpus):
    total = len(corpus.train_N) + len(corpus.val_M)
    assert total == 5_057_321  # the size recorded in diloco_jax/data/NOTICE.md
    assert len(corpus.val_M) == round(total * 0.05)
    text = bytes(corpus.train_N[:200]).decode("ascii")
    assert "ALL'S WELL THAT ENDS WELL" in text
    assert 3.2 < unigram_entropy(corpus.val_M) < 3.4  # ~3.3 nats per character


def test_replica_windows_stay_in_disjoint_shards(corpus):
    seq_len, replicas = 32, 4
    shard_len = shard_bounds(len(corpus.train_N), replicas, seq_len)
    positions_RxS = jnp.asarray(replica_shards(np.arange(len(corpus.train_N)), replicas, seq_len))
    seen = []
    for r in range(replicas):
        starts = []
        for step in range(3):
            batch = sample_batch(positions_RxS[r], seed=0, replica=jnp.int32(r),
                                 step=jnp.int32(step), batch_size=64, seq_len=seq_len)  # fmt: skip
            # indices come back in place of tokens: every window is contiguous and in shard r
            batch = np.asarray(batch)
            np.testing.assert_array_equal(np.diff(batch, axis=1), 1)
            assert batch.min() >= r * shard_len and batch.max() < (r + 1) * shard_len
            starts.append(batch[:, 0])
        seen.append(np.concatenate(starts))
    assert len(np.unique(np.concatenate(seen))) > 0.9 * sum(len(s) for s in seen)


def test_batch_is_a_pure_function_of_seed_replica_step(corpus):
    shards_RxS = jnp.asarray(replica_shards(corpus.train_N, 2, 16))

    def batch(seed, replica, step):
        return np.asarray(sample_batch(shards_RxS[replica], seed=seed, replica=jnp.int32(replica),
                                       step=jnp.int32(step), batch_size=8, seq_len=16))  # fmt: skip

    np.testing.assert_array_equal(batch(0, 1, 5), batch(0, 1, 5))
    assert not np.array_equal(batch(0, 1, 5), batch(0, 1, 6))
    assert not np.array_equal(batch(0, 1, 5), batch(1, 1, 5))
    assert not np.array_equal(batch(0, 0, 5), batch(0, 1, 5))


def test_eval_windows_spread_over_validation(corpus):
    windows = eval_windows(corpus.val_M, seq_len=64, max_windows=10)
    assert windows.shape == (10, 65)
    np.testing.assert_array_equal(windows[0], corpus.val_M[:65])
    everything = eval_windows(corpus.val_M, seq_len=64, max_windows=0)
    assert everything.shape[0] == (len(corpus.val_M) - 1) // 64


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*nope.txt"):
        load_corpus(str(tmp_path / "nope.txt"), val_fraction=0.1)


def test_corrupt_compressed_file(tmp_path):
    path = tmp_path / "broken.txt.xz"
    path.write_bytes(lzma.compress(b"hello world " * 100)[:40])
    with pytest.raises(DataError, match="cannot read data file .*broken.txt.xz"):
        load_corpus(str(path), val_fraction=0.1)


def test_local_text_file_and_too_small(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij" * 100)
    c = load_corpus(str(path), val_fraction=0.1)
    assert len(c.val_M) == 100 and bytes(c.train_N[:3]) == b"abc"
    with pytest.raises(DataError, match="too small for 4 replica shards"):
        shard_bounds(len(c.train_N), 4, 300)
    path.write_text("ab")
    with pytest.raises(DataError, match="too small to split"):
        load_corpus(str(path), val_fraction=0.1)


def test_a_rewritten_compressed_file_is_read_anew(tmp_path):
    """A compressed corpus is decompressed once per process while unchanged; a new file at the
    same path is read again."""
    path = tmp_path / "c.txt.xz"
    path.write_bytes(lzma.compress(b"abcdefghij" * 100))
    assert bytes(load_corpus(str(path), val_fraction=0.1).train_N[:3]) == b"abc"
    assert bytes(load_corpus(str(path), val_fraction=0.1).train_N[:3]) == b"abc"
    path.write_bytes(lzma.compress(b"zyxwvutsrq" * 120))
    assert bytes(load_corpus(str(path), val_fraction=0.1).train_N[:3]) == b"zyx"
