"""Image-classification data: the 8x8 digits (shipped inside the package as ``digits.npz``, no
download; see NOTICE.md), or any TFDS image dataset prepared locally (``tfds:NAME``,
:mod:`diloco_jax.data.tfds_images`).

``load_images("digits", val_fraction)`` shuffles the 1,797 8x8 grayscale digits once with a fixed
seed and keeps the last ``val_fraction`` for validation; its pixels are float32 in [0, 1]. A TFDS
dataset keeps its own splits and uint8 pixels (4x less memory), scaled to [0, 1] when sampled
(:func:`as_float`). Replicas get contiguous, disjoint shards of the training examples
(:func:`image_shards`); the examples a replica trains on at a step are a pure function of
``(seed, replica, step)`` (:func:`sample_images`).
"""

from __future__ import annotations

import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.base.randomness import replica_key
from diloco_jax.data.corpus import DataError

IMAGE_DATASETS = ("digits",)
_DIGITS = pathlib.Path(__file__).with_name("digits.npz")


class Images(NamedTuple):
    train_images: np.ndarray  # [N, H, W, C]: float32 in [0, 1], or uint8 (see as_float)
    train_labels: np.ndarray  # int32 [N]
    val_images: np.ndarray
    val_labels: np.ndarray
    num_classes: int


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The shipped digits (UCI "Optical Recognition of Handwritten Digits", as scikit-learn's
    ``load_digits`` returns them): ``(images_Nx8x8, labels_N)``, uint8, N = 1797, pixels 0..16,
    labels 0..9, in scikit-learn's order."""
    with np.load(_DIGITS) as digits:
        return digits["images"], digits["labels"]


def image_shards(images: np.ndarray, labels: np.ndarray, replicas: int):
    """``(images_RxSx..., labels_RxS)``: contiguous, disjoint shards (the last N mod R unused)."""
    size = len(labels) // replicas
    if size < 1:
        raise DataError(f"{len(labels)} training examples are too few for {replicas} replicas")
    keep = replicas * size
    return (images[:keep].reshape(replicas, size, *images.shape[1:]),
            labels[:keep].reshape(replicas, size))  # fmt: skip


def as_float(images):
    """Pixels as float32 in [0, 1]: uint8 images divided by 255, float images as they are."""
    if images.dtype == jnp.uint8:
        return images.astype(jnp.float32) * jnp.float32(1 / 255)
    return images


def example_indices(*, seed, replica, step, batch_size: int, shard_len: int):
    """int32 ``[batch_size]``: which examples of its shard of ``shard_len`` ``replica`` trains on
    at ``step`` (uniform, with replacement), drawn from ``fold_in(fold_in(key(seed), step),
    replica)``. The one function behind the device sampler and the host's streamed reads."""
    key = replica_key(seed, step, replica)
    return jax.random.randint(key, (batch_size,), 0, shard_len, dtype=jnp.int32)


def sample_images(shard, *, seed, replica, step, batch_size: int):
    """The ``batch_size`` examples ``replica`` trains on at ``step`` from its shard
    ``(images_Sx..., labels_S)`` (:func:`example_indices`), pixels as floats."""
    images_S, labels_S = shard
    idx_B = example_indices(seed=seed, replica=replica, step=step, batch_size=batch_size,
                            shard_len=labels_S.shape[0])  # fmt: skip
    return as_float(images_S[idx_B]), labels_S[idx_B]
