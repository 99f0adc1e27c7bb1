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
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
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


def split(eval_fn: Callable, placed, count: int, devices: list) -> Split:
    """``evaluate(params) -> {name: float}``: ``params`` replicated on ``devices`` (a mesh's, in
    its order), ``placed`` from :func:`place` holding ``count`` examples; device ``d`` evaluates
    the real rows of its block."""
    return Split(eval_fn, placed, count, devices)


class Split:
    """The evaluation of :func:`split`: called with the parameters, or compiled ahead."""

    def __init__(self, eval_fn: Callable, placed, count: int, devices: list):
        self.eval_fn, self.count, self.devices = eval_fn, count, devices
        rows = jax.tree.leaves(placed)[0].shape[0] // len(devices)
        self.sizes = [max(0, min(count - d * rows, rows)) for d in range(len(devices))]
        self.mine = [d for d, device in enumerate(devices)
                     if device.process_index == jax.process_index() and self.sizes[d]]  # fmt: skip
        self.blocks = {d: jax.tree.map(lambda x, d=d: _on(x, devices[d])[: self.sizes[d]], placed)
                       for d in self.mine}  # fmt: skip
        self.block_shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), placed
        )

    def __call__(self, params) -> dict[str, float]:
        devices, sizes = self.devices, self.sizes
        outs = {d: self.eval_fn(jax.tree.map(lambda x, d=d: _on(x, devices[d]), params),
                                self.blocks[d])
                for d in self.mine}  # fmt: skip  # dispatched to every device before any is read
        outs = jax.device_get(outs)
        names = self._names(params)
        sums_DxK = np.zeros((len(devices), len(names)))
        for d, out in outs.items():
            sums_DxK[d] = [float(out[k]) * sizes[d] for k in names]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            sums_DxK = np.asarray(multihost_utils.process_allgather(sums_DxK)).sum(axis=0)
        return {k: float(v) / self.count for k, v in zip(names, sums_DxK.sum(axis=0), strict=True)}

    def _names(self, params) -> list[str]:
        return sorted(jax.eval_shape(self.eval_fn, params, self.block_shapes))  # every process's

    def compile_ahead(self, params_like) -> None:
        """Compiles (or loads from the persistent cache) each block's evaluation for parameters
        shaped like ``params_like`` (arrays or ``ShapeDtypeStruct``), without running it: the
        first call then compiles nothing. Nothing for an ``eval_fn`` that is not jitted."""
        if not hasattr(self.eval_fn, "lower"):
            return
        for d in self.mine:
            on_d = SingleDeviceSharding(self.devices[d])  # as _on gives each device its copy
            like = jax.tree.map(
                lambda x, s=on_d: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params_like
            )
            self.eval_fn.lower(like, self.blocks[d]).compile()
        self._names(params_like)


class Replicated(NamedTuple):
    """The evaluation with its data replicated: one device (the simulator), or every device
    evaluating every example (an evaluation that is not a mean over examples)."""

    eval_fn: Callable
    data: Any

    def __call__(self, params) -> dict:
        return self.eval_fn(params, self.data)

    def compile_ahead(self, params_like) -> None:
        """As :meth:`Split.compile_ahead`, for the parameters as they will come."""
        if hasattr(self.eval_fn, "lower"):
            self.eval_fn.lower(params_like, self.data).compile()


def _rows(eval_data, devices: list) -> int:
    return math.ceil(jax.tree.leaves(eval_data)[0].shape[0] / len(devices))


def _on(x: jax.Array, device) -> jax.Array:
    """``device``'s own shard of ``x`` (its copy of a replicated array)."""
    for shard in x.addressable_shards:
        if shard.device == device:
            return shard.data
    raise ValueError(f"no part of the array lives on {device}")
