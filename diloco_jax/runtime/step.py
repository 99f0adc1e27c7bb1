"""The train step, written once for one replica.

``make_replica_step`` returns ``replica_step(state, replica, shard, control) -> (state,
metrics)`` for a single replica (``shard``: its own slice of the training data). The simulator
runs it under ``jax.vmap`` and the mesh runtime under ``jax.shard_map``
(:mod:`diloco_jax.runtime.parallel`); no other implementation of the algorithm exists.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diloco_jax.base import randomness
from diloco_jax.runtime import fsdp
from diloco_jax.tasks import Task


class StepControl(NamedTuple):
    """Per-replica inputs of one step, set by the simulator's straggler and failure schedules.

    Attributes (each ``[R]`` per step, ``[N, R]`` for a call of N steps):
      active: bool. False: the replica skips its inner step (idle straggler).
      weight: float32. The replica's weight in the pseudo-gradient mean at a sync (0: left out).
      take_anchor: bool. False: at a sync the replica keeps its own parameters.
      outer_scale: float32. Multiplies DiLoCo's outer step: the outer learning rate where the
        config passes it as an input (:func:`diloco_jax.config.recipe.outer_lr_input`) times
        its scale changed over HTTP (:mod:`diloco_jax.watch.serve`); the same for every replica.
      seed: int32. The run's seed, from which each replica's batches and dropout masks are
        drawn. An input rather than a constant of the compiled step, so runs that differ only
        in their seed (a sweep's ``--seeds``) share one compiled step; the same for every
        replica.
    """

    active: jax.Array
    weight: jax.Array
    take_anchor: jax.Array
    outer_scale: jax.Array
    seed: jax.Array

    def update_masks(self) -> dict:
        """The fields that ``algorithm.update`` takes (all but the seed)."""
        return {k: v for k, v in self._asdict().items() if k != "seed"}


def full_control(num_steps: int, replicas: int, seed: int = 0) -> StepControl:
    """Every replica active, weight 1, restarting from the anchor: plain DiLoCo, with ``seed``."""
    return StepControl(
        active=jnp.ones((num_steps, replicas), bool),
        weight=jnp.ones((num_steps, replicas), jnp.float32),
        take_anchor=jnp.ones((num_steps, replicas), bool),
        outer_scale=jnp.ones((num_steps, replicas), jnp.float32),
        seed=jnp.full((num_steps, replicas), seed, jnp.int32),
    )


def make_replica_step(
    algorithm,
    task: Task,
    *,
    batch_size: int,
    data_axis: str | None = None,
    controlled: bool = True,
    dropout: bool = False,
    streamed: bool = False,
):
    """One inner step of one replica: ``replica_step(state, replica, shard, control) ->
    (state, metrics)``, ``control`` a :class:`StepControl` for this replica. With
    ``controlled=False`` the masks are ignored (plain DiLoCo, no per-step masking work); the
    outer learning rate's scale is not.

    ``algorithm``: :func:`diloco_jax.algorithm.diloco` or a baseline; its state holds the
    replica's ``params`` and the shared ``step``. The replica draws ``batch = task.sample(shard,
    seed, replica, step)`` (``seed``: ``control.seed``, an input of the call), then
    ``algorithm.update`` takes the inner step and, with DiLoCo, syncs the replicas when its plan
    says so.

    ``data_axis``: the replica's batch is split over this mesh axis, which belongs to XLA's
    partitioner (the mesh's ``shard_map`` is manual over ``REPLICA`` only): the whole batch is
    drawn, its rows constrained to ``data_axis``, and the loss is the task's loss of the whole
    batch, its gradient reduced by XLA. Nothing is sliced or averaged here, so a loss that is not
    a mean of equal row groups (padding, token weights) is the same function on every layout.

    With ``dropout`` the loss gets the key :func:`diloco_jax.base.randomness.replica_key` of
    ``(seed, step, replica)`` and the ``DROPOUT`` stream, on every layout: no device or shard
    index enters it. Whatever the loss draws from it for a row is then the same on one device and
    on a data split, because JAX's random bits are partitionable (``jax_threefry_partitionable``,
    on by default: an element's bits depend on the key and its index in the whole array, not on
    which device computes it). Without ``dropout`` the loss gets ``None``.

    With ``streamed`` the ``shard`` argument is already this step's batch, read from disk by
    the host (:mod:`diloco_jax.data.stream`: the same windows ``task.sample`` would draw).

    Metrics: ``loss`` and whatever ``algorithm.update`` returns (DiLoCo's sync statistics).
    """

    def replica_step(state, replica: jax.Array, shard, control: StepControl):
        seed = control.seed
        batch = (
            shard
            if streamed
            else task.sample(
                shard, seed=seed, replica=replica, step=state.step, batch_size=batch_size
            )
        )
        if data_axis is not None:
            batch = fsdp.rows(batch, data_axis)
        key = None
        if dropout:
            key = randomness.replica_key(seed, state.step, replica, randomness.DROPOUT)
        loss_fn = task.loss if task.aux else lambda *args: (task.loss(*args), {})
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, key)
        extra = control.update_masks() if controlled else {"outer_scale": control.outer_scale}
        state, metrics = algorithm.update(state, grads, **extra)
        return state, {"loss": loss, **metrics, **({"aux": aux} if task.aux else {})}

    return replica_step


def scan_steps(step_fn, num_steps: int, *, per_step_data: bool = False):
    """``run(state, replicas_R, shards_R, control_NxR)``: ``step_fn(state, replicas_R, shards_R,
    control_R) -> (state, metrics)`` ``num_steps`` times in one compiled loop (small models on
    CPU are dispatch-bound); metrics come back stacked ``[num_steps, ...]``. With
    ``per_step_data`` the data argument is ``[num_steps, R, ...]`` (streamed batches), one slice
    per step."""

    def run(state, replicas_R, shards_R, control_NxR):
        def body(state, xs):
            control_R, data_R = xs if per_step_data else (xs, shards_R)
            return step_fn(state, replicas_R, data_R, control_R)

        xs = (control_NxR, shards_R) if per_step_data else control_NxR
        return lax.scan(body, state, xs, length=num_steps)

    return run
