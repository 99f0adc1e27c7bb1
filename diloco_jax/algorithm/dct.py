"""The chunked top-k of DCT momentum and SparseLoCo
(:func:`diloco_jax.algorithm.exchange.dct_momentum`).

A float32 vector is cut into chunks ``x_NxS`` of ``S`` values; each chunk is transformed by the
orthonormal DCT-II ``C_NxS = x_NxS @ D_SxS.T`` (so ``x = C @ D``: the inverse is the transpose).
Of each chunk's ``S`` coefficients the ``K`` largest in magnitude travel, as float32 values and
their positions (``uint8`` for ``S <= 256``); what is not sent stays in the local momentum.
DeMo (Peng et al., arXiv 2411.19870) uses 2-D chunks of weight matrices; we use 1-D chunks of the
flattened parameters, which needs no shapes and treats every leaf alike.

SparseLoCo (Sarfi et al., 2025, arXiv 2508.15706) is the same accumulator without the transform
(``dct=False``: the top-k of each chunk of the accumulator itself) and with the kept values
quantized to ``bits=2``: each chunk's values become one of ``{-1, -1/3, 1/3, 1}`` times the
chunk's largest kept magnitude (a float32 scale per chunk), four 2-bit codes packed per byte.
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
    """DCT momentum, the ``dct_config`` of :func:`~diloco_jax.diloco`: each replica keeps a
    local momentum of its pseudo-gradients, cuts it into chunks, transforms each by a DCT and
    sends only the largest components (DeMo); with ``dct=False`` and ``bits=2``, SparseLoCo.

    Args:
      chunk: values per DCT chunk (S), >= 2.
      topk: components sent per chunk (K), in ``[1, chunk]``.
      beta: momentum decay of the local accumulator, in ``[0, 1]``.
      min_size: leaves with fewer values are averaged in float32.
      dct: False: the chunks' own values, not their DCT (SparseLoCo).
      bits: bits of each sent value: 32 (float32) or 2 (SparseLoCo's quantizer).
    """

    chunk: int = 64
    topk: int = 4
    beta: float = 0.9
    min_size: int = 4096
    dct: bool = True  # False: the chunks' own values (SparseLoCo)
    bits: int = 32  # of each sent value: 32 (float32) or 2 (SparseLoCo's quantizer)


BITS = (32, 2)
SPARSELOCO = DctConfig(chunk=4096, topk=64, beta=0.95, dct=False, bits=2)  # k/S = 1.6%


def validate(config: DctConfig) -> None:
    """Raises :class:`~diloco_jax.algorithm.options.OptionError` for a field out of range."""
    require(config.chunk >= 2, "dct.chunk", config.chunk, "must be an integer >= 2")
    require(1 <= config.topk <= config.chunk, "dct.topk", config.topk,
            f"must be in [1, {{dct.chunk}} = {config.chunk}]")  # fmt: skip
    require(0 <= config.beta <= 1, "dct.beta", config.beta, "must be in [0, 1]")
    require(config.min_size >= 0, "dct.min_size", config.min_size, "must be >= 0")
    require(config.bits in BITS, "dct.bits", config.bits, f"must be one of {BITS}")


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


def extract(flat: jax.Array, config: DctConfig):
    """``(message, kept)``: each chunk's ``topk`` largest coefficients (DCT, or the values
    themselves), as :func:`quantize` sends them, and ``flat`` minus what the message decodes to
    (what stays local)."""
    x_NxS = flat.reshape(-1, config.chunk)
    c_NxS = _forward(x_NxS) if config.dct else x_NxS
    _, idx_NxK = lax.top_k(jnp.abs(c_NxS), config.topk)
    vals_NxK = jnp.take_along_axis(c_NxS, idx_NxK, axis=1)
    message = quantize(vals_NxK, idx_NxK.astype(position_dtype(config.chunk)), config.bits)
    sent_NxS = _scatter(dequantize(message, config.topk), message[1], config.chunk)
    return message, _inverse(c_NxS - sent_NxS, config.dct)


def _forward(x_NxS: jax.Array) -> jax.Array:
    d_SxS = jnp.asarray(matrix(x_NxS.shape[1]))
    return jnp.dot(x_NxS, d_SxS.T, precision=lax.Precision.HIGHEST)


_LEVELS = np.array([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0], np.float32)  # 2-bit codes 0..3


def quantize(vals_NxK: jax.Array, idx_NxK: jax.Array, bits: int):
    """A message ``(values, idx, scale_N)``: float32 values (``bits=32``, ``scale`` unused), or
    (``bits=2``) codes of the nearest level ``_LEVELS * scale_N``, four packed per uint8."""
    if bits == 32:
        return vals_NxK, idx_NxK, jnp.zeros(vals_NxK.shape[0], jnp.float32)
    scale_N = jnp.abs(vals_NxK).max(axis=1)
    unit_NxK = vals_NxK / jnp.maximum(scale_N, 1e-30)[:, None]
    codes_NxK = jnp.clip(jnp.round((unit_NxK + 1.0) * 1.5), 0, 3).astype(jnp.uint8)
    pad = -codes_NxK.shape[1] % 4
    codes_NxQx4 = jnp.pad(codes_NxK, ((0, 0), (0, pad))).reshape(codes_NxK.shape[0], -1, 4)
    packed_NxQ = (codes_NxQx4 << jnp.arange(0, 8, 2, dtype=jnp.uint8)).sum(-1, jnp.uint8)
    return packed_NxQ, idx_NxK, scale_N


def dequantize(message, topk: int) -> jax.Array:
    """The float32 values ``[N, K]`` a message carries."""
    values, _, scale_N = message
    if values.dtype == jnp.float32:
        return values
    codes_NxQx4 = (values[..., None] >> jnp.arange(0, 8, 2, dtype=jnp.uint8)) & 3
    codes_NxK = codes_NxQx4.reshape(values.shape[0], -1)[:, :topk]
    return jnp.asarray(_LEVELS)[codes_NxK] * scale_N[:, None]


def _scatter(vals_NxK: jax.Array, idx_NxK: jax.Array, chunk: int, into=None) -> jax.Array:
    """``into`` (or zeros ``[N, S]``) plus ``vals`` at (row, ``idx``): positions are distinct
    within a row (one message's top-k), so no index repeats and the scatter is deterministic."""
    rows_Nx1 = jnp.arange(vals_NxK.shape[0])[:, None]
    into = jnp.zeros((vals_NxK.shape[0], chunk), jnp.float32) if into is None else into
    return into.at[rows_Nx1, idx_NxK.astype(jnp.int32)].add(vals_NxK, unique_indices=True)


def decode(message, config: DctConfig) -> jax.Array:
    """The flat float32 vector one message stands for."""
    vals_NxK = dequantize(message, config.topk)
    return _inverse(_scatter(vals_NxK, message[1], config.chunk), config.dct)


def decode_sum(messages_R, config: DctConfig) -> jax.Array:
    """The sum of ``R`` messages (each leaf with a leading ``[R]``): ``x = (sum_r C_r) @ D``
    where ``C_r`` holds message ``r``'s coefficients; the ``C_r`` are added into one float32
    ``[N, S]`` in the order ``r = 0, 1, ...`` (never a scatter of several messages' positions at
    once, which may repeat)."""

    def add(r, c_NxS):
        message = jax.tree.map(lambda x: x[r], messages_R)
        return _scatter(dequantize(message, config.topk), message[1], config.chunk, c_NxS)

    rows = messages_R[1].shape[1]
    c_NxS = jnp.zeros((rows, config.chunk), jnp.float32)
    return _inverse(compress.fold(add, messages_R[1].shape[0], c_NxS), config.dct)


def _inverse(c_NxS: jax.Array, transform: bool = True) -> jax.Array:
    if not transform:
        return c_NxS.reshape(-1)
    d_SxS = jnp.asarray(matrix(c_NxS.shape[1]))
    return jnp.dot(c_NxS, d_SxS, precision=lax.Precision.HIGHEST).reshape(-1)


def message_bytes(num_values: int, config: DctConfig) -> int:
    """Bytes one replica's message takes, per chunk: ``K`` positions and ``K`` float32 values,
    or (``bits=2``) ``K`` 2-bit codes packed four per byte and one float32 scale."""
    chunks = padded(num_values, config.chunk) // config.chunk
    positions = config.topk * np.dtype(position_dtype(config.chunk)).itemsize
    values = 4 * config.topk if config.bits == 32 else -(-config.topk // 4) + 4
    return chunks * (positions + values)
