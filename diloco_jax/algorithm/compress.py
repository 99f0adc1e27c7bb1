"""Pseudo-gradient codecs and the compressed sum over replicas that moves their bytes.

A codec encodes a float32 vector cut into blocks ``x_NxB`` (N blocks of B values) into the arrays
that travel, and decodes them back to float32:

* ``bf16``: bfloat16 values (2 bytes per value);
* ``int8``: per block, ``scale = max|x| / 127`` (float32) and ``round(x / scale)`` as int8;
* ``fp8``: per block, ``scale = max|x| / 448`` and ``x / scale`` as float8 e4m3;
* ``int4``: per block, ``scale = max|x| / 7`` and ``round(x / scale)`` in [-7, 7], two values
  packed per byte;
* ``topk``: the ``topk_fraction`` largest-magnitude values (float32) and their int32 positions;
* ``none``: float32 as it is (:data:`FLOAT32`: small leaves summed through the same ring).

:func:`compressed_sum` is the all-reduce over the ``n`` replicas, which span one named axis (a
``vmap`` axis in the simulator, a mesh axis under ``shard_map``) or several (on a mesh: the
virtual replicas of a device, then the devices). Every replica encodes its own vector cut into
``n`` chunks; chunk ``r`` goes to replica ``r`` (an ``all_to_all`` per axis name), which decodes
what it got and sums it in float32 in replica order, encodes the sum again, and an ``all_gather``
brings every summed chunk to everyone (a reduce-scatter and an all-gather, as a ring all-reduce,
with encoded payloads). ``topk`` instead all-gathers every replica's (values, positions) and adds
them up replica by replica. Nothing depends on how replicas are placed on devices: every layout
makes the simulator's float32 additions in the same order, and no decoder scatters duplicate
indices (whose order of addition would be unspecified).

Replica order: with axis names ``(a_1, ..., a_k)`` (the last one between devices) replica
``(i_1, ..., i_k)`` is number ``r = i_k * n_1 ... n_(k-1) + ... + i_2 * n_1 + i_1``, the index
the mesh runtime gives it (``device * local_count + local``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diloco_jax.algorithm.options import require

CODECS = ("none", "bf16", "int8", "fp8", "int4", "topk")
AxisName = str | Sequence[str]
_UNROLL = 8  # replicas up to which fold() is unrolled
_LEVELS = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}  # largest code magnitude per block scale


class Codec(NamedTuple):
    """How pseudo-gradients travel at a sync: the ``codec`` of :func:`~diloco_jax.diloco`.

    Args:
      name: ``"none"`` (float32), ``"bf16"``, ``"int8"``, ``"fp8"``, ``"int4"`` (each block of
        values with its own float32 scale) or ``"topk"`` (only the ``topk_fraction``
        largest-magnitude values, with their positions).
      block: values per scale (an even integer >= 2).
      topk_fraction: the share of values ``topk`` keeps, in ``(0, 1]``.
      min_size: leaves with fewer values stay float32.
      error_feedback: what encoding lost is kept by the replica and added to its next
        pseudo-gradient.
    """

    name: str = "none"
    block: int = 256
    topk_fraction: float = 0.01
    min_size: int = 4096
    error_feedback: bool = False


def validate(codec: Codec) -> None:
    """Raises :class:`~diloco_jax.algorithm.options.OptionError` for a field out of range."""
    require(codec.name in CODECS, "codec.name", codec.name, f"must be one of {CODECS}")
    require(codec.block >= 2 and codec.block % 2 == 0, "codec.block", codec.block,
            "must be an even integer >= 2")  # fmt: skip
    require(0 < codec.topk_fraction <= 1, "codec.topk_fraction", codec.topk_fraction,
            "must be in (0, 1]")  # fmt: skip
    require(codec.min_size >= 0, "codec.min_size", codec.min_size, "must be >= 0")


def _scale(x_NxB: jax.Array, levels: float) -> jax.Array:
    return jnp.max(jnp.abs(x_NxB), axis=-1, keepdims=True) / levels


def _safe_div(x, scale):
    return x / jnp.where(scale > 0, scale, 1.0)


def encode(x_NxB: jax.Array, name: str) -> tuple[jax.Array, ...]:
    """The arrays that travel for the float32 blocks ``x_NxB`` (see the module docstring)."""
    if name == "none":
        return (x_NxB,)
    if name == "bf16":
        return (x_NxB.astype(jnp.bfloat16),)
    scale_Nx1 = _scale(x_NxB, _LEVELS[name])
    y_NxB = _safe_div(x_NxB, scale_Nx1)
    if name == "int8":
        return jnp.clip(jnp.round(y_NxB), -127, 127).astype(jnp.int8), scale_Nx1
    if name == "fp8":
        return y_NxB.astype(jnp.float8_e4m3fn), scale_Nx1
    if name == "int4":
        q_NxB = (jnp.clip(jnp.round(y_NxB), -7, 7) + 8).astype(jnp.uint8)  # 1..15
        return q_NxB[:, 0::2] | (q_NxB[:, 1::2] << 4), scale_Nx1
    raise ValueError(f"no blockwise codec {name!r}")


def decode(encoded: tuple[jax.Array, ...], name: str) -> jax.Array:
    """Float32 blocks from :func:`encode`'s arrays."""
    if name in ("none", "bf16"):
        return encoded[0].astype(jnp.float32)
    q, scale_Nx1 = encoded
    if name == "int4":
        low, high = (q & 15).astype(jnp.float32) - 8, (q >> 4).astype(jnp.float32) - 8
        q = jnp.stack([low, high], axis=-1).reshape(q.shape[0], -1)
    return q.astype(jnp.float32) * scale_Nx1


def roundtrip(x_NxB: jax.Array, name: str) -> jax.Array:
    return decode(encode(x_NxB, name), name)


def topk_count(size: int, fraction: float) -> int:
    return max(1, min(size, math.ceil(size * fraction)))


def encoded_bytes(num_values: int, codec: Codec) -> int:
    """Bytes of one encoded message of ``num_values`` values (a multiple of the block size for
    the blockwise codecs)."""
    if codec.name == "none":
        return 4 * num_values
    if codec.name == "topk":
        return 8 * topk_count(num_values, codec.topk_fraction)  # float32 value + int32 position
    blocks = -(-num_values // codec.block)
    per_value = {"bf16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5}[codec.name]
    scales = 0 if codec.name == "bf16" else 4 * blocks
    return int(per_value * blocks * codec.block) + scales


def padded_size(num_values: int, members: int, block: int) -> int:
    """The length :func:`compressed_sum` pads a vector to: a multiple of ``members * block``."""
    unit = members * block
    return -(-num_values // unit) * unit


FLOAT32 = Codec("none", block=1)  # float32 values through the same ring: sums in replica order


def names(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def replica_count(axis_name: AxisName) -> int:
    """``n``: the product of the axes' sizes (a constant when they are known at trace time)."""
    return math.prod(int(lax.psum(1, name)) for name in names(axis_name))


def gather_in_order(tree: Any, axis_name: AxisName) -> Any:
    """Every replica's ``tree``, each leaf stacked ``[n, ...]`` in replica order.

    The device axis (the last name) is gathered first: a device sends its own replicas' values
    once; the replicas a device holds are then gathered in memory."""
    axes = names(axis_name)
    for j, name in enumerate(reversed(axes)):
        tree = lax.all_gather(tree, name, axis=j)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[len(axes) :]), tree)


def route_chunks(chunks_n: jax.Array, axis_name: AxisName) -> jax.Array:
    """``out[s]`` = chunk ``r`` of replica ``s``'s ``chunks_n`` (``[n, ...]``), for this replica
    ``r``: every replica's chunk ``r`` comes to replica ``r``, stacked in replica order (an
    ``all_to_all`` per axis name; the dtype travels as it is)."""
    axes = names(axis_name)
    sizes = [int(lax.psum(1, name)) for name in reversed(axes)]
    x = chunks_n.reshape(*sizes, *chunks_n.shape[1:])
    for j, name in enumerate(reversed(axes)):
        x = lax.all_to_all(x, name, j, j, tiled=True)
    return x.reshape(-1, *x.shape[len(axes) :])


def fold(fn: Callable[[int | jax.Array, Any], Any], count: int, init: Any) -> Any:
    """``fn(count - 1, ... fn(1, fn(0, init)))``: a sum over replicas taken in replica order, so
    every layout adds the same float32 values in the same order, and only one replica's terms
    are materialized at a time. Unrolled for a few replicas (it compiles faster), a
    ``lax.fori_loop`` for more (code of one term whatever ``count``)."""
    if count > _UNROLL:
        return lax.fori_loop(0, count, fn, init)
    for r in range(count):
        init = fn(r, init)
    return init


def ordered_sum(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """``sum_r x_r`` over the replicas, added in replica order (an all-gather; for scalars)."""
    x_n = gather_in_order(x, axis_name)
    return fold(lambda r, acc: acc + x_n[r], x_n.shape[0], jnp.zeros_like(x))


def _topk_sum(flat_P: jax.Array, axis_name: AxisName, codec: Codec):
    k = topk_count(flat_P.shape[0], codec.topk_fraction)
    _, idx_K = lax.top_k(jnp.abs(flat_P), k)  # k distinct positions
    vals_K = flat_P[idx_K]
    lost_P = flat_P.at[idx_K].set(0.0, unique_indices=True)
    vals_nxK, idx_nxK = gather_in_order((vals_K, idx_K), axis_name)

    def add(r, acc_P):  # one replica's positions are distinct: no duplicate in the scatter
        return acc_P.at[idx_nxK[r]].add(vals_nxK[r], unique_indices=True)

    return fold(add, vals_nxK.shape[0], jnp.zeros_like(flat_P)), lost_P


def compressed_sum(flat_P: jax.Array, axis_name: AxisName, codec: Codec):
    """``(total_P, lost_P)``, float32: the sum over replicas of their decoded messages and what
    this replica's own encoding lost. With ``Q = decode . encode`` (blockwise) and ``x_r`` the
    ``flat_P`` of replica ``r``::

        total = Q(sum_r Q(x_r))    (the sum in float32, in replica order)
        lost  = x - Q(x)           (what error feedback keeps; the second Q is not fed back)

    ``topk``: ``total = sum_r topk(x_r)``, ``lost = x - topk(x)``. Blockwise codes do not depend
    on the chunking (chunks are whole blocks; zero padding leaves a block's scale alone), so every
    placement of the replicas computes the same values.
    """
    if codec.name == "topk":
        return _topk_sum(flat_P, axis_name, codec)
    n, size = replica_count(axis_name), flat_P.shape[0]
    padded = padded_size(size, n, codec.block)
    x_NxB = jnp.pad(flat_P, (0, padded - size)).reshape(-1, codec.block)
    mine = encode(x_NxB, codec.name)
    lost_P = (x_NxB - decode(mine, codec.name)).reshape(-1)[:size]
    # chunk r of my message (N / n blocks) goes to replica r; I get my chunk of everybody's
    got = [route_chunks(a.reshape(n, -1, *a.shape[1:]), axis_name) for a in mine]

    def add(r, acc_CxB):
        return acc_CxB + decode(tuple(a[r] for a in got), codec.name)

    chunk_CxB = fold(add, n, jnp.zeros((padded // n // codec.block, codec.block), jnp.float32))
    summed = encode(chunk_CxB, codec.name)
    every = [gather_in_order(a, axis_name).reshape(-1, *a.shape[1:]) for a in summed]
    return decode(tuple(every), codec.name).reshape(-1)[:size], lost_P
