"""Data: the shipped Shakespeare corpus, byte-level tokens, per-replica sharding."""

from diloco_jax.data.corpus import (
    SHAKESPEARE,
    VOCAB_SIZE,
    Corpus,
    DataError,
    eval_windows,
    load_corpus,
    replica_shards,
    sample_batch,
    shard_bounds,
    unigram_entropy,
)

__all__ = [
    "SHAKESPEARE",
    "VOCAB_SIZE",
    "Corpus",
    "DataError",
    "eval_windows",
    "load_corpus",
    "replica_shards",
    "sample_batch",
    "shard_bounds",
    "unigram_entropy",
]
