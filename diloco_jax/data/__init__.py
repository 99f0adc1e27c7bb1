"""Data: the shipped corpora, text files and prepared TFDS datasets (:mod:`~diloco_jax.data.sources`
picks the reader), byte-level tokens, per-replica sharding, streaming from disk."""

from diloco_jax.data.corpus import (
    SHAKESPEARE,
    VOCAB_SIZE,
    Corpus,
    DataError,
    eval_windows,
    replica_shards,
    sample_batch,
    shard_bounds,
    unigram_entropy,
)
from diloco_jax.data.sources import is_image_data, load_corpus, load_images

__all__ = [
    "SHAKESPEARE",
    "VOCAB_SIZE",
    "Corpus",
    "DataError",
    "eval_windows",
    "is_image_data",
    "load_corpus",
    "load_images",
    "replica_shards",
    "sample_batch",
    "shard_bounds",
    "unigram_entropy",
]
