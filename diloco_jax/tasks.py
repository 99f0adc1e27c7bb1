"""Tasks other than language modelling: what a replica samples, its loss, the evaluation.

The train step (:func:`diloco_jax.step.make_replica_step`) takes a task's ``sample`` and
``loss``; ``diloco_jax.train`` picks the task from ``data.corpus`` (an image dataset name such
as ``digits`` means image classification).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diloco_jax import vision
from diloco_jax.data.images import as_float, sample_images


class Task(NamedTuple):
    sample: Callable  # (shard, *, seed, replica, step, batch_size) -> batch (rows first)
    loss: Callable  # (graphdef, params, batch, dropout_key) -> mean loss
    make_eval_fn: Callable  # graphdef -> jit (params, eval_data) -> {"eval_loss", ...}


def _image_loss(graphdef, params, batch, dropout_key):
    del dropout_key  # the ResNet has no dropout
    images_BxHxWxC, labels_B = batch
    return vision.cross_entropy(vision.apply(graphdef, params, images_BxHxWxC), labels_B).mean()


def _image_eval_fn(graphdef, *, chunk: int = 512):
    """Loss and accuracy over every validation example, ``chunk`` at a time (padded and masked)
    to bound memory."""

    @jax.jit
    def eval_fn(params, data):
        images_NxHxWxC, labels_N = data
        count = labels_N.shape[0]
        chunk_ = min(chunk, count)
        pad = -count % chunk_
        images = jnp.pad(images_NxHxWxC, ((0, pad),) + ((0, 0),) * (images_NxHxWxC.ndim - 1))
        labels = jnp.pad(labels_N, (0, pad))
        mask = jnp.arange(count + pad) < count

        def chunk_sums(args):
            images_KxHxWxC, labels_K, mask_K = args
            logits_KxC = vision.apply(graphdef, params, as_float(images_KxHxWxC))
            nll_K = vision.cross_entropy(logits_KxC, labels_K)
            right_K = logits_KxC.argmax(-1) == labels_K
            return (nll_K * mask_K).sum(), (right_K * mask_K).sum()

        def chunks(x):
            return x.reshape(-1, chunk_, *x.shape[1:])

        nll, right = lax.map(chunk_sums, (chunks(images), chunks(labels), chunks(mask)))
        return {"eval_loss": nll.sum() / count, "accuracy": right.sum() / count}

    return eval_fn


IMAGE_CLASSIFICATION = Task(sample_images, _image_loss, _image_eval_fn)
