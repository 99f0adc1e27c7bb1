"""The evaluation of the outer parameters, its examples split over the devices that hold them.

The outer parameters are replicated on every device of the mesh, and so was the evaluation's
data: every device evaluated every example. For a task whose evaluation is a mean over examples
(``Task.eval_mean``: the built-in tasks, a user's default evaluation), :func:`place` lays the
examples out in contiguous blocks, one per device (``ceil(N / D)`` rows each, the last block
padded), and :func:`split` has each device evaluate its own block's rows at once; the blocks'
means are combined on the host, weighted by their sizes (float64). The result is the
single-device evaluation up to float32 rounding (a block's sum is taken in another order), and
the same on every layout with the same devices: 1 process of 2 devices and 2 processes of 1
evaluate the same blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "eval"


def applies(eval_mean: bool, eval_data, devices: list) -> bool:
    """Whether the evaluation splits: a mean over examples, several devices, a block each."""
    count = jax.tree.leaves(eval_data)[0].shape[0]
    return eval_mean and len(devices) > 1 and count >= len(devices)


def place(eval_data, devices: list, *, abstract: bool = False):
    """``eval_data`` (host arrays ``[N, ...]``) as arrays ``[D * ceil(N / D), ...]`` whose
    block ``d`` lives on ``devices[d]`` (zero rows pad the last block), or their shapes with
    that sharding (``abstract``); each process places its own devices' blocks."""
    rows = _rows(eval_data, devices)
    sharding = NamedSharding(Mesh(np.asarray(devices), (AXIS,)), P(AXIS))

    def one(x):
        shape = (rows * len(devices), *x.shape[1:])
        if abstract:
            return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
        padded = np.zeros(shape, x.dtype)
        padded[: x.shape[0]] = x
        return jax.make_array_from_callback(shape, sharding, lambda index: padded[index])

    return jax.tree.map(one, eval_data)


def split(eval_fn: Callable, placed, count: int, devices: list) -> Callable:
    """``evaluate(params) -> {name: float}``: ``params`` replicated on ``devices`` (a mesh's, in
    its order), ``placed`` from :func:`place` holding ``count`` examples; device ``d`` evaluates
    the real rows of its block."""
    rows = jax.tree.leaves(placed)[0].shape[0] // len(devices)
    sizes = [max(0, min(count - d * rows, rows)) for d in range(len(devices))]
    mine = [d for d, device in enumerate(devices)
            if device.process_index == jax.process_index() and sizes[d]]  # fmt: skip
    blocks = {d: jax.tree.map(lambda x, d=d: _on(x, devices[d])[: sizes[d]], placed)
              for d in mine}  # fmt: skip
    block_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype),
                                placed)  # fmt: skip

    def evaluate(params) -> dict[str, float]:
        outs = {d: eval_fn(jax.tree.map(lambda x, d=d: _on(x, devices[d]), params), blocks[d])
                for d in mine}  # fmt: skip  # dispatched to every device before any is read
        outs = jax.device_get(outs)
        names = sorted(jax.eval_shape(eval_fn, params, block_shapes))  # every process's
        sums_DxK = np.zeros((len(devices), len(names)))
        for d, out in outs.items():
            sums_DxK[d] = [float(out[k]) * sizes[d] for k in names]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            sums_DxK = np.asarray(multihost_utils.process_allgather(sums_DxK)).sum(axis=0)
        return {k: float(v) / count for k, v in zip(names, sums_DxK.sum(axis=0), strict=True)}

    return evaluate


def _rows(eval_data, devices: list) -> int:
    return math.ceil(jax.tree.leaves(eval_data)[0].shape[0] / len(devices))


def _on(x: jax.Array, device) -> jax.Array:
    """``device``'s own shard of ``x`` (its copy of a replicated array)."""
    for shard in x.addressable_shards:
        if shard.device == device:
            return shard.data
    raise ValueError(f"no part of the array lives on {device}")
