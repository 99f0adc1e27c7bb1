"""A small ResNet for image classification, in Flax NNX, and its pure functional form.

``images_BxHxWxC`` (float) -> ``logits_BxK``: a 3x3 convolution stem, ``depth`` residual blocks
per stage (GroupNorm -> ReLU -> 3x3 conv, twice, plus the identity), stages of ``width``,
``2 width``, ... channels with stride 2 between them (a 1x1 projection on the skip), global
average pooling and a linear head. GroupNorm rather than BatchNorm: no running statistics, so the
model is a pure function of its parameters, like the Transformer (and DiLoCo averages only
parameters).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .model import described, split_built


def _groups(channels: int) -> int:
    return max(g for g in (8, 4, 2, 1) if channels % g == 0)


class ResidualBlock(nnx.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.GroupNorm(c_in, num_groups=_groups(c_in), rngs=rngs)
        self.conv1 = nnx.Conv(c_in, c_out, (3, 3), strides=stride, rngs=rngs)
        self.norm2 = nnx.GroupNorm(c_out, num_groups=_groups(c_out), rngs=rngs)
        self.conv2 = nnx.Conv(c_out, c_out, (3, 3), rngs=rngs)
        self.project = c_in != c_out or stride != 1
        if self.project:
            self.skip = nnx.Conv(c_in, c_out, (1, 1), strides=stride, use_bias=False, rngs=rngs)

    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        y = self.conv1(jax.nn.relu(self.norm1(x_BxHxWxC)))
        y = self.conv2(jax.nn.relu(self.norm2(y)))
        return y + (self.skip(x_BxHxWxC) if self.project else x_BxHxWxC)


class ResNet(nnx.Module):
    def __init__(self, *, channels: int, num_classes: int, width: int, stages: int, depth: int,
                 rngs: nnx.Rngs):  # fmt: skip
        self.stem = nnx.Conv(channels, width, (3, 3), rngs=rngs)
        blocks, c = [], width
        for stage in range(stages):
            c_out = width * 2**stage
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(ResidualBlock(c, c_out, stride, rngs=rngs))
                c = c_out
        self.blocks = nnx.List(blocks)
        self.norm = nnx.GroupNorm(c, num_groups=_groups(c), rngs=rngs)
        self.head = nnx.Linear(c, num_classes, rngs=rngs)

    def __call__(self, images_BxHxWxC: jax.Array) -> jax.Array:
        x = self.stem(images_BxHxWxC)
        for block in self.blocks:
            x = block(x)
        return self.head(jax.nn.relu(self.norm(x)).mean(axis=(1, 2)))


def init_model(seed: int, *, abstract: bool = False, **kwargs) -> tuple[nnx.GraphDef, Any]:
    """``(graphdef, params)`` of a :class:`ResNet` built from ``kwargs`` (``params`` of shapes
    only with ``abstract``)."""
    same_as = ("ResNet", described(kwargs))
    return split_built(lambda rngs: ResNet(**kwargs, rngs=rngs), seed, same_as=same_as,
                       abstract=abstract)  # fmt: skip


def apply(graphdef: nnx.GraphDef, params: Any, images_BxHxWxC: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, nnx.State(params))(images_BxHxWxC)


def cross_entropy(logits_BxK: jax.Array, labels_B: jax.Array) -> jax.Array:
    """Per-example negative log-likelihood ``nll_B`` in nats (float32)."""
    logp_BxK = jax.nn.log_softmax(logits_BxK.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BxK, labels_B[:, None], axis=-1)[:, 0]
