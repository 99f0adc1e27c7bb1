"""Tasks other than language modelling: what a replica samples, its loss, the evaluation.

The train step (:func:`diloco_jax.step.make_replica_step`) takes a task's ``sample`` and
``loss``; ``diloco_jax.train`` picks the task from ``data.corpus`` (an image dataset name such
as ``digits`` means image classification).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax

from diloco_jax import vision
from diloco_jax.data.images import sample_images


class Task(NamedTuple):
    sample: Callable  # (shard, *, seed, replica, step, batch_size) -> batch (rows first)
    loss: Callable  # (graphdef, params, batch, dropout_key) -> mean loss
    make_eval_fn: Callable  # graphdef -> jit (params, eval_data) -> {"eval_loss", ...}


def _image_loss(graphdef, params, batch, dropout_key):
    del dropout_key  # the ResNet has no dropout
    images_BxHxWxC, labels_B = batch
    return vision.cross_entropy(vision.apply(graphdef, params, images_BxHxWxC), labels_B).mean()


def _image_eval_fn(graphdef):
    @jax.jit
    def eval_fn(params, data):
        images_NxHxWxC, labels_N = data
        logits_NxK = vision.apply(graphdef, params, images_NxHxWxC)
        return {
            "eval_loss": vision.cross_entropy(logits_NxK, labels_N).mean(),
            "accuracy": (logits_NxK.argmax(-1) == labels_N).mean(),
        }

    return eval_fn


IMAGE_CLASSIFICATION = Task(sample_images, _image_loss, _image_eval_fn)
