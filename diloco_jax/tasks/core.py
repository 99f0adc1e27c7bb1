"""Tasks: what a replica samples, its loss, and the evaluation of the outer parameters.

A :class:`Task` is built for one model (its ``graphdef``) and one data layout, so the train
step (:func:`diloco_jax.runtime.step.make_replica_step`) is generic: language modelling and image
classification go through the same step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diloco_jax.data import sample_batch
from diloco_jax.data.images import as_float, sample_images
from diloco_jax.tasks import model as model_lib
from diloco_jax.tasks import vision


class Task(NamedTuple):
    """``sample(shard, *, seed, replica, step, batch_size) -> batch`` (rows first; ``seed``,
    ``replica`` and ``step`` are int32 scalars of the compiled step, so one compiled step serves
    every seed);
    ``loss(params, batch, dropout_key) -> mean loss``; ``eval_fn(params, eval_data) ->
    {"eval_loss", ...}`` (jitted); ``unit``: what one batch row counts as (``token``s of
    ``tokens_per_row``, or one ``example``)."""

    sample: Callable
    loss: Callable
    eval_fn: Callable
    unit: str = "token"
    tokens_per_row: int = 1
    rng: bool = False  # the loss always gets a key (else only with the model's dropout)
    aux: bool = False  # the loss returns (loss, {name: scalar}): metrics logged as aux_<name>
    # eval_fn's values are means over the examples: blocks evaluated on several devices combine
    # into the whole (runtime/evaluation.py)
    eval_mean: bool = False


class Problem(NamedTuple):
    """What a run learns, as the training loop takes it: each replica's data (``shards``, or a
    ``stream`` of batches read on the host), the evaluation data, the initial ``params`` and the
    ``task`` over them (how a replica samples a batch, its loss and the evaluation). Built by
    the built-in tasks (``diloco_jax.config.problems``) and by a user's
    (:meth:`ArrayTask.problem <diloco_jax.ArrayTask.problem>`,
    :meth:`GrainTask.problem <diloco_jax.GrainTask.problem>`)."""

    shards: Any  # [R, S] tokens, or a task's pytree of [R, S, ...] arrays
    eval_data: Any
    graphdef: Any  # the built-in models' (text samples); None for a user's task
    params: Any
    task: Task  # sample, loss and evaluation for this model and data
    baseline_nats: float  # unigram entropy of the tokens, or log(classes); nan if unknown
    tokenizer: Any = None
    streamed: bool = False  # batches are read on the host: a memory map on disk, or a pipeline
    # (num_steps=) -> a stream of the calls' batches (a user's pipelines: tasks/pipeline.py);
    # None: data.stream's over ``shards``
    stream: Callable | None = None


def _chunked(fn, count: int, chunk: int, *arrays):
    """Sums of ``fn(*chunk_arrays, mask_K)`` over ``arrays`` cut into chunks of ``chunk`` rows,
    padded with zeros and masked, to bound memory."""
    pad = -count % chunk
    mask = jnp.arange(count + pad) < count
    padded = [jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) for x in arrays]
    chunks = [x.reshape(-1, chunk, *x.shape[1:]) for x in (*padded, mask)]
    return lax.map(lambda args: fn(*args), tuple(chunks))


def language_model(graphdef, *, seq_len: int, chunk: int = 64) -> Task:
    """Next-token prediction with the Transformer: windows of ``seq_len + 1`` tokens from the
    replica's shard; the evaluation is the mean nats per token over every validation window."""

    def loss(params, tokens_BxL1, dropout_key):
        logits_BxLxV = model_lib.apply(graphdef, params, tokens_BxL1[:, :-1], dropout_key)
        return model_lib.token_nll(logits_BxLxV, tokens_BxL1[:, 1:]).mean()

    @jax.jit
    def eval_fn(params, windows_WxL1):
        def chunk_loss(tokens_KxL1, mask_K):
            logits_KxLxV = model_lib.apply(graphdef, params, tokens_KxL1[:, :-1])
            nll_KxL = model_lib.token_nll(logits_KxLxV, tokens_KxL1[:, 1:])
            return (nll_KxL.mean(axis=-1) * mask_K).sum()

        count = windows_WxL1.shape[0]
        return {"eval_loss": _chunked(chunk_loss, count, chunk, windows_WxL1).sum() / count}

    sample = functools.partial(sample_batch, seq_len=seq_len)
    return Task(sample, loss, eval_fn, "token", seq_len, eval_mean=True)


def image_classification(graphdef, *, chunk: int = 512) -> Task:
    """Classification with the ResNet: examples drawn with replacement from the replica's shard;
    the evaluation gives loss and accuracy over every validation example."""

    def loss(params, batch, dropout_key):
        del dropout_key  # the ResNet has no dropout
        images_BxHxWxC, labels_B = batch  # streamed batches hold uint8 pixels
        return vision.cross_entropy(vision.apply(graphdef, params, as_float(images_BxHxWxC)),
                                    labels_B).mean()  # fmt: skip

    @jax.jit
    def eval_fn(params, data):
        def chunk_sums(images_KxHxWxC, labels_K, mask_K):
            logits_KxC = vision.apply(graphdef, params, as_float(images_KxHxWxC))
            nll_K = vision.cross_entropy(logits_KxC, labels_K)
            right_K = logits_KxC.argmax(-1) == labels_K
            return (nll_K * mask_K).sum(), (right_K * mask_K).sum()

        images_NxHxWxC, labels_N = data
        count = labels_N.shape[0]
        nll, right = _chunked(chunk_sums, count, min(chunk, count), images_NxHxWxC, labels_N)
        return {"eval_loss": nll.sum() / count, "accuracy": right.sum() / count}

    return Task(sample_images, loss, eval_fn, "example", 1, eval_mean=True)
