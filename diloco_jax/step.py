"""The train step, written once for one replica, and the evaluation of the anchor.

``make_replica_step`` returns ``replica_step(state, replica, shard_S, control) -> (state,
metrics)`` for a single replica (``shard_S``: its own slice of the training tokens). The
simulator runs it under ``jax.vmap`` and the mesh runtime under ``jax.shard_map``
(``diloco_jax.parallel``); no other implementation of the algorithm exists.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from diloco_jax import model as model_lib
from diloco_jax.data import sample_batch
from diloco_jax.diloco import (
    EagerDilocoState,
    apply_updates,
    find_anchor,
    find_diloco_state,
    replica_axes,
)

_DROPOUT_STREAM = 0x0D0  # keeps dropout keys apart from the batch keys of sample_batch


class TrainState(NamedTuple):
    """Everything that evolves during training.

    Attributes:
      step: int32 scalar, shared: inner steps taken by every replica. Drives data sampling.
      params: per-replica (``[R, ...]`` when replica-stacked) parameters.
      opt_state: the transform's state; which parts are per-replica is given by
        :func:`diloco_jax.diloco.replica_axes` (DiLoCo keeps its anchor and outer state once).
    """

    step: jax.Array
    params: Any
    opt_state: Any


class StepControl(NamedTuple):
    """Per-replica inputs of one step, set by the simulator's straggler and failure schedules.

    Attributes (each ``[R]`` per step, ``[N, R]`` for a call of N steps):
      active: bool. False: the replica skips its inner step (idle straggler).
      weight: float32. The replica's weight in the pseudo-gradient mean at a sync (0: left out).
      take_anchor: bool. False: at a sync the replica keeps its own parameters.
    """

    active: jax.Array
    weight: jax.Array
    take_anchor: jax.Array


def full_control(num_steps: int, replicas: int) -> StepControl:
    """Every replica active, weight 1, restarting from the anchor: plain DiLoCo."""
    return StepControl(
        active=jnp.ones((num_steps, replicas), bool),
        weight=jnp.ones((num_steps, replicas), jnp.float32),
        take_anchor=jnp.ones((num_steps, replicas), bool),
    )


def state_axes(state: TrainState) -> TrainState:
    """``vmap`` axes prefix of a replica-stacked TrainState: 0 per-replica, None shared."""
    return TrainState(step=None, params=0, opt_state=replica_axes(state.opt_state))


def init_state(params: Any, tx: optax.GradientTransformation, replicas: int) -> TrainState:
    """The replica-stacked initial state: every replica starts from ``params``; shared parts
    (step, DiLoCo's anchor and outer state) are stored once. The result owns fresh buffers, so
    donating it to a step never invalidates the caller's ``params``."""
    state = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))

    def stack(axis, subtree):
        if axis is None:
            return jax.tree.map(jnp.copy, subtree)
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *jnp.shape(x))), subtree)

    return jax.tree.map(stack, state_axes(state), state, is_leaf=lambda x: x is None)


def make_replica_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    *,
    seed: int,
    batch_size: int,
    seq_len: int,
    data_axis: str | None = None,
    data_shards: int = 1,
    controlled: bool = True,
    dropout: bool = False,
    task=None,
):
    """One inner step of one replica: ``replica_step(state, replica, shard_S, control) ->
    (state, metrics)``, ``control`` a :class:`StepControl` for this replica. With
    ``controlled=False`` the control is ignored (plain DiLoCo, no per-step masking work).

    The replica draws its batch ``tokens_BxL1 = sample_batch(shard_S, seed, replica, step)``; with a
    ``data_axis`` each of its ``data_shards`` devices takes its ``B / data_shards`` rows and the
    loss and gradients are averaged over ``data_axis`` (explicitly: the mesh runtime runs
    ``shard_map`` with ``check_vma=False``, so nothing is summed behind our back). Then
    ``params += tx.update(grads)``; with DiLoCo, ``tx`` syncs the replicas every ``sync_every``
    steps. With ``dropout`` the model's dropout is active, its key drawn from ``(seed, step,
    replica)`` (and the data shard: masks then differ from an unsharded run's).

    ``task``: another task's ``(sample(shard, seed, replica, step, batch_size) -> batch,
    loss(graphdef, params, batch, dropout_key) -> loss)`` (:mod:`diloco_jax.tasks`); None: the
    language model on token shards.
    """
    if batch_size % data_shards:
        raise ValueError(f"batch_size {batch_size} is not divisible by data_shards {data_shards}")
    rows = batch_size // data_shards

    def lm_loss(params, tokens_BxL1, dropout_key):
        logits_BxLxV = model_lib.apply(graphdef, params, tokens_BxL1[:, :-1], dropout_key)
        return model_lib.token_nll(logits_BxLxV, tokens_BxL1[:, 1:]).mean()

    loss_fn = lm_loss if task is None else functools.partial(task.loss, graphdef)

    def sample(shard_S, replica, step):
        if task is not None:
            return task.sample(shard_S, seed=seed, replica=replica, step=step,
                               batch_size=batch_size)  # fmt: skip
        return sample_batch(shard_S, seed=seed, replica=replica, step=step,
                            batch_size=batch_size, seq_len=seq_len)  # fmt: skip

    def replica_step(state: TrainState, replica: jax.Array, shard_S: jax.Array, control):
        batch = sample(shard_S, replica, state.step)  # tokens_BxL1, or a task's pytree of rows
        if data_axis is not None:
            start = lax.axis_index(data_axis) * rows
            batch = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, start, rows), batch)
        key = None
        if dropout:  # a pure function of (seed, step, replica, data shard), like the batch
            key = jax.random.fold_in(jax.random.key(seed), state.step)
            key = jax.random.fold_in(jax.random.fold_in(key, replica), _DROPOUT_STREAM)
            if data_axis is not None:
                key = jax.random.fold_in(key, lax.axis_index(data_axis))
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, key)
        if data_axis is not None and data_shards > 1:
            loss, grads = lax.pmean((loss, grads), data_axis)
        extra = control._asdict() if controlled else {}
        updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
        params = apply_updates(state.params, updates, opt_state)
        metrics = {"loss": loss}
        diloco_state = find_diloco_state(opt_state)
        if diloco_state is not None:
            metrics.update(diloco_state.stats._asdict())
        return TrainState(state.step + 1, params, opt_state), metrics

    return replica_step


def scan_steps(step_fn, num_steps: int):
    """``run(state, replicas_R, shards_RxS, control_NxR)``: ``step_fn(state, replicas_R,
    shards_RxS, control_R) -> (state, metrics)`` ``num_steps`` times in one compiled loop
    (small models on CPU are dispatch-bound); metrics come back stacked ``[num_steps, ...]``."""

    def run(state, replicas_R, shards_RxS, control_NxR):
        def body(state, control_R):
            return step_fn(state, replicas_R, shards_RxS, control_R)

        return lax.scan(body, state, control_NxR, length=num_steps)

    return run


def outer_params(state: TrainState) -> Any:
    """The parameters to evaluate: DiLoCo's anchor (with eager updates, where every replica has
    its own, their mean), else replica 0's parameters."""
    diloco_state = find_diloco_state(state.opt_state)
    if isinstance(diloco_state, EagerDilocoState):
        return jax.tree.map(lambda x: x.mean(axis=0), diloco_state.anchor)
    anchor = find_anchor(state.opt_state)
    if anchor is not None:
        return anchor
    return jax.tree.map(lambda x: x[0], state.params)


def make_eval_fn(graphdef: nnx.GraphDef, *, chunk: int = 64):
    """``eval_fn(params, windows_WxL1) -> mean nats per token`` over all windows, in chunks of
    ``chunk`` windows (padded and masked) to bound memory."""

    @jax.jit
    def eval_fn(params, windows_WxL1):
        count = windows_WxL1.shape[0]
        pad = -count % chunk
        padded = jnp.pad(windows_WxL1, ((0, pad), (0, 0)))
        mask = jnp.arange(count + pad) < count
        chunks_CxKxL1 = padded.reshape(-1, chunk, padded.shape[-1])

        def chunk_loss(args):
            tokens_KxL1, mask_K = args
            logits_KxLxV = model_lib.apply(graphdef, params, tokens_KxL1[:, :-1])
            nll_KxL = model_lib.token_nll(logits_KxLxV, tokens_KxL1[:, 1:])
            return (nll_KxL.mean(axis=-1) * mask_K).sum()

        totals = lax.map(chunk_loss, (chunks_CxKxL1, mask.reshape(-1, chunk)))
        return totals.sum() / count

    return eval_fn
