"""Pseudo-gradient codecs and the compressed sum over replicas that moves their bytes.

A codec encodes a float32 vector cut into blocks ``x_NxB`` (N blocks of B values) into the arrays
that travel, and decodes them back to float32:

* ``bf16``: bfloat16 values (2 bytes per value);
* ``int8``: per block, ``scale = max|x| / 127`` (float32) and ``round(x / scale)`` as int8;
* ``fp8``: per block, ``scale = max|x| / 448`` and ``x / scale`` as float8 e4m3;
* ``int4``: per block, ``scale = max|x| / 7`` and ``round(x / scale)`` in [-7, 7], two values
  packed per byte;
* ``topk``: the ``topk_fraction`` largest-magnitude values (float32) and their int32 positions.

:func:`compressed_sum` is the all-reduce over one named axis of ``n`` members (a ``vmap`` axis in
the simulator, a mesh axis under ``shard_map``): each member encodes its vector cut into ``n``
chunks, an ``all_to_all`` sends chunk ``i`` to member ``i``, which decodes and sums what it got in
float32, encodes the sum again and ``all_gather`` brings every summed chunk to everyone (a
reduce-scatter and an all-gather, as a ring all-reduce, with encoded payloads). ``topk`` instead
all-gathers every member's (values, positions) and adds them up. Accumulation is in float32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

CODECS = ("none", "bf16", "int8", "fp8", "int4", "topk")
_LEVELS = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}  # largest code magnitude per block scale


class Codec(NamedTuple):
    """How pseudo-gradients travel. ``name`` in :data:`CODECS`; ``block``: values per scale;
    ``topk_fraction``: share of values ``topk`` keeps; ``min_size``: leaves with fewer values stay
    float32; ``error_feedback``: what encoding lost is kept by the replica and added to its next
    pseudo-gradient."""

    name: str = "none"
    block: int = 256
    topk_fraction: float = 0.01
    min_size: int = 4096
    error_feedback: bool = False


def validate(codec: Codec) -> None:
    if codec.name not in CODECS:
        raise ValueError(f"codec {codec.name!r} is not one of {CODECS}")
    if codec.block < 2 or codec.block % 2:
        raise ValueError(f"codec block {codec.block} must be an even number >= 2")
    if not 0 < codec.topk_fraction <= 1:
        raise ValueError(f"topk fraction {codec.topk_fraction} must be in (0, 1]")


def _scale(x_NxB: jax.Array, levels: float) -> jax.Array:
    return jnp.max(jnp.abs(x_NxB), axis=-1, keepdims=True) / levels


def _safe_div(x, scale):
    return x / jnp.where(scale > 0, scale, 1.0)


def encode(x_NxB: jax.Array, name: str) -> tuple[jax.Array, ...]:
    """The arrays that travel for the float32 blocks ``x_NxB`` (see the module docstring)."""
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
    if name == "bf16":
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


def _axis_size(axis_name: str) -> int:
    return int(lax.psum(1, axis_name))  # a constant when the axis size is known at trace time


def compressed_sum(flat_P: jax.Array, axis_name: str, codec: Codec):
    """``(sum over axis_name of the decoded messages, what this member's encoding lost)``.

    The loss (``flat_P`` minus what this member's own message decodes to) is what error feedback
    keeps; the second encoding, of the summed chunks, is not fed back.
    """
    n, size = _axis_size(axis_name), flat_P.shape[0]
    if codec.name == "topk":
        k = topk_count(size, codec.topk_fraction)
        _, idx_K = lax.top_k(jnp.abs(flat_P), k)
        vals_K = flat_P[idx_K]
        sent_P = jnp.zeros_like(flat_P).at[idx_K].set(vals_K)
        vals_nK, idx_nK = lax.all_gather((vals_K, idx_K), axis_name)
        total_P = jnp.zeros_like(flat_P).at[idx_nK.reshape(-1)].add(vals_nK.reshape(-1))
        return total_P, flat_P - sent_P
    padded = padded_size(size, n, codec.block)
    x_nxNxB = jnp.pad(flat_P, (0, padded - size)).reshape(n, -1, codec.block)
    mine = encode(x_nxNxB.reshape(-1, codec.block), codec.name)
    lost_P = (x_nxNxB.reshape(-1) - decode(mine, codec.name).reshape(-1))[:size]
    mine = jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), mine)  # chunk i -> member i
    got = [lax.all_to_all(a, axis_name, 0, 0, tiled=True) for a in mine]
    chunk_NxB = sum(
        decode(tuple(a[j] for a in got), codec.name) for j in range(n)
    )  # float32 sum of every member's chunk of mine
    summed = encode(chunk_NxB, codec.name)
    every = [lax.all_gather(a, axis_name, tiled=True) for a in summed]
    total_P = decode(tuple(every), codec.name).reshape(-1)[:size]
    return total_P, lost_P
