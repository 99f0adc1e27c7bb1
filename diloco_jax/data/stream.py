"""Training data read from disk call by call, for corpora larger than memory.

A plain (uncompressed) text file is its own byte-token array, so it is memory-mapped, never read
whole (:func:`map_text`). Each compiled call of ``N`` steps then gets its batches as an argument,
``[N, R, B, L + 1]`` int32 tokens: the host draws the window starts with the very function the
in-memory path runs on device (:func:`diloco_jax.data.corpus.window_starts`, a pure function of
``(seed, replica, step)``) and reads only those windows from the file. Batches are therefore
identical to the in-memory run's, and a resumed run reads what it would have read. Each process
reads only the windows of the replicas its own devices hold.
"""

from __future__ import annotations

import functools
import pathlib
from typing import NamedTuple

import jax
import numpy as np

from diloco_jax.data.corpus import DataError, window_starts
from diloco_jax.data.images import example_indices

_COMPRESSED = (".xz", ".gz")


def map_text(path: str | pathlib.Path) -> np.ndarray:
    """The bytes of an uncompressed text file as a read-only ``uint8`` memory map."""
    path = pathlib.Path(path).expanduser()
    if path.suffix in _COMPRESSED:
        raise DataError(f"data file {path} is compressed and cannot be streamed: decompress it "
                        "or raise data.max_memory_mib")  # fmt: skip
    try:
        return np.memmap(path, dtype=np.uint8, mode="r")
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except (OSError, ValueError) as e:
        raise DataError(f"cannot map data file {path}: {e}") from None


@functools.partial(jax.jit, static_argnames=("batch_size", "shard_len", "seq_len"))
def _starts_NxRxB(seed, steps_N, replicas_R, *, batch_size: int, shard_len: int, seq_len: int):
    def one(step, replica):
        return window_starts(seed=seed, replica=replica, step=step, batch_size=batch_size,
                             shard_len=shard_len, seq_len=seq_len)  # fmt: skip

    return jax.vmap(jax.vmap(one, in_axes=(None, 0)), in_axes=(0, None))(steps_N, replicas_R)


class StreamedShards(NamedTuple):
    """The replicas' shards ``[R, S]`` on disk (a view of a memory map) and how a call's batches
    are drawn from them."""

    shards_RxS: np.ndarray
    seed: int
    batch_size: int
    seq_len: int
    num_steps: int  # steps per compiled call
    first_replica: int = 0  # the index of shard 0 among every replica's (a learner's first)

    def starts(self, first_step: int, replicas: range) -> np.ndarray:
        """int32 ``[N, len(replicas), B]``: window starts of ``num_steps`` steps from
        ``first_step``, computed on the host CPU (compiled once per shape)."""
        steps = np.arange(first_step, first_step + self.num_steps, dtype=np.int32)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            starts = _starts_NxRxB(
                np.int32(self.seed),
                steps,
                np.asarray(replicas, np.int32) + np.int32(self.first_replica),
                batch_size=self.batch_size,
                shard_len=self.shards_RxS.shape[1],
                seq_len=self.seq_len,
            )
        return np.asarray(starts)

    def batches(self, first_step: int, replicas: range) -> np.ndarray:
        """int32 ``[N, len(replicas), B, L + 1]``: the tokens of those replicas' windows."""
        starts = self.starts(first_step, replicas)
        cols = starts[..., None] + np.arange(self.seq_len + 1, dtype=np.int64)
        rows = np.asarray(replicas, dtype=np.int64)[None, :, None, None]
        return np.asarray(self.shards_RxS[rows, cols], dtype=np.int32)

    def abstract(self) -> jax.ShapeDtypeStruct:
        """A call's batches as a shape."""
        shape = (self.num_steps, self.shards_RxS.shape[0], self.batch_size, self.seq_len + 1)
        return jax.ShapeDtypeStruct(shape, np.int32)

    def on_devices(self, first_step: int, sharding: jax.sharding.Sharding) -> jax.Array:
        """A call's batches on the devices as ``sharding`` places them; each process reads only
        the replicas its own devices hold."""
        return _from_replicas(self.abstract(), sharding, lambda rs: self.batches(first_step, rs))


def _from_replicas(shape: jax.ShapeDtypeStruct, sharding, read) -> jax.Array:
    """A ``[N, R, ...]`` array made by each device's ``read(its replicas)``."""

    def part(index):
        replicas = range(*index[1].indices(shape.shape[1]))
        return read(replicas)[(index[0], slice(None), *index[2:])]

    return jax.make_array_from_callback(shape.shape, sharding, part)


@functools.partial(jax.jit, static_argnames=("batch_size", "shard_len"))
def _indices_NxRxB(seed, steps_N, replicas_R, *, batch_size: int, shard_len: int):
    def one(step, replica):
        return example_indices(seed=seed, replica=replica, step=step, batch_size=batch_size,
                               shard_len=shard_len)  # fmt: skip

    return jax.vmap(jax.vmap(one, in_axes=(None, 0)), in_axes=(0, None))(steps_N, replicas_R)


class StreamedImages(NamedTuple):
    """The replicas' image shards on disk (``images_RxS...``, a view of a memory map of uint8
    pixels; ``labels_RxS`` in memory) and how a call's batches are drawn from them: the host
    picks the examples with the device sampler's own function
    (:func:`diloco_jax.data.images.example_indices`) and reads only those. Batches hold uint8
    pixels (a quarter of float32's bytes to move); the task scales them on the device."""

    images_RxS: np.ndarray  # [R, S, H, W, C] uint8
    labels_RxS: np.ndarray  # [R, S] int32
    seed: int
    batch_size: int
    num_steps: int
    first_replica: int = 0  # the index of shard 0 among every replica's (a learner's first)

    def indices(self, first_step: int, replicas: range) -> np.ndarray:
        """int32 ``[N, len(replicas), B]``: the examples of ``num_steps`` steps."""
        steps = np.arange(first_step, first_step + self.num_steps, dtype=np.int32)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            global_R = np.asarray(replicas, np.int32) + np.int32(self.first_replica)
            idx = _indices_NxRxB(np.int32(self.seed), steps, global_R,
                                 batch_size=self.batch_size,
                                 shard_len=self.labels_RxS.shape[1])  # fmt: skip
        return np.asarray(idx)

    def images(self, first_step: int, replicas: range) -> np.ndarray:
        """uint8 ``[N, len(replicas), B, H, W, C]``: only these examples are read from disk."""
        rows = np.asarray(replicas, dtype=np.int64)[None, :, None]
        return np.asarray(self.images_RxS[rows, self.indices(first_step, replicas)])

    def labels(self, first_step: int, replicas: range) -> np.ndarray:
        """int32 ``[N, len(replicas), B]``."""
        rows = np.asarray(replicas, dtype=np.int64)[None, :, None]
        return self.labels_RxS[rows, self.indices(first_step, replicas)]

    def batches(self, first_step: int, replicas: range):
        return self.images(first_step, replicas), self.labels(first_step, replicas)

    def abstract(self):
        """A call's batches as shapes: ``(images, labels)``."""
        n, (r, _, *pixels) = self.num_steps, self.images_RxS.shape
        return (jax.ShapeDtypeStruct((n, r, self.batch_size, *pixels), np.uint8),
                jax.ShapeDtypeStruct((n, r, self.batch_size), np.int32))  # fmt: skip

    def on_devices(self, first_step: int, shardings):
        """A call's batches placed by ``shardings`` (one per leaf), each process reading only
        its own devices' replicas."""
        reads = (self.images, self.labels)
        return tuple(_from_replicas(shape, sharding, functools.partial(read, first_step))
                     for shape, sharding, read in zip(self.abstract(), shardings, reads,
                                                      strict=True))  # fmt: skip


def make_stream(shards, *, seed: int, batch_size: int, seq_len: int, num_steps: int,
                first_replica: int = 0):  # fmt: skip
    """The stream of a problem's memory-mapped shards: text windows (an ``[R, S]`` token array)
    or images (an ``(images, labels)`` pair). ``first_replica``: the index of the first shard's
    replica among every replica's (a learner's part: its batches are drawn as that replica's)."""
    if isinstance(shards, tuple):
        images_RxS, labels_RxS = shards
        return StreamedImages(images_RxS, labels_RxS, seed, batch_size, num_steps, first_replica)
    return StreamedShards(shards, seed, batch_size, seq_len, num_steps, first_replica)
