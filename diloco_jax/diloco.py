"""DiLoCo as an optax transform (Douillard et al., 2023, arXiv 2311.08105, Algorithm 1).

Each replica ``r`` runs an inner optimizer on its own data. Every ``sync_every`` inner steps the
replicas average their pseudo-gradients and an outer optimizer moves the shared anchor::

    delta_r   = anchor - params_r                      # pseudo-gradient (points uphill)
    delta     = mean_r delta_r                         # lax.pmean over the replica axis
    anchor'   = anchor + outer.update(delta, outer_state, anchor)
    params_r' = anchor'                                # every replica restarts from the anchor

With outer ``sgd(1.0)`` the anchor becomes the plain average of the replicas' parameters
(FedAvg); the paper's outer optimizer is Nesterov SGD, lr 0.7, momentum 0.9.

The transform is written for one replica: it must run under a named axis (``jax.vmap(...,
axis_name=...)`` or ``jax.shard_map``) that spans the replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

AxisName = str | Sequence[str]


class DilocoState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      step: int32 scalar, shared by all replicas (never has a replica axis, so the sync
        ``lax.cond`` stays a real branch under ``vmap``). Inner steps taken so far.
      inner_state: per-replica (``[R, ...]`` when replica-stacked). The inner optimizer's state,
        kept across syncs unless ``reset_inner_state``.
      anchor: shared. The outer ("global") parameters after the last sync.
      outer_state: shared. The outer optimizer's state (e.g. its Nesterov momentum).
    """

    step: jax.Array
    inner_state: optax.OptState
    anchor: optax.Params
    outer_state: optax.OptState


def replica_mean(tree: Any, axis_name: AxisName) -> Any:
    """Mean of ``tree`` over the replica axis, which may be several named axes.

    Several names are reduced one after the other (mean of equal-size group means equals the
    global mean). One ``pmean`` over a tuple mixing a ``vmap`` axis and a ``shard_map`` axis is not
    lowered by jax 0.10, so we never ask for one.
    """
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    for name in names:
        tree = lax.pmean(tree, name)
    return tree


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    *,
    sync_every: int,
    axis_name: AxisName = "replica",
    reset_inner_state: bool = False,
) -> optax.GradientTransformation:
    """DiLoCo: ``sync_every`` local steps of ``inner``, then one ``outer`` step on the anchor.

    Args:
      inner: the per-replica optimizer (the paper: AdamW).
      outer: the optimizer of the anchor, fed the replica-mean pseudo-gradient (the paper:
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
      sync_every: inner steps between syncs (the paper's H). Must be >= 1.
      axis_name: the named axis (or axes, reduced in order) spanning the replicas.
      reset_inner_state: re-initialise the inner state from the new anchor at every sync. The
        paper keeps it; note that a reset also restarts any step count inside ``inner`` (and so its
        learning-rate schedule).

    Returns:
      A transform whose ``update`` returns the inner update on ordinary steps and, on a sync step,
      ``anchor' - params`` so that ``optax.apply_updates`` lands every replica on the new anchor
      (to within one float rounding of ``params + (anchor' - params)``).
    """
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")

    def init_fn(params):
        return DilocoState(
            step=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
            anchor=params,
            outer_state=outer.init(params),
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("diloco needs params: call tx.update(grads, state, params)")
        inner_updates, inner_state = inner.update(updates, state.inner_state, params)
        step = state.step + 1

        def sync(operand):
            inner_updates, inner_state = operand
            local = optax.apply_updates(params, inner_updates)
            delta = jax.tree.map(lambda a, p: a - p, state.anchor, local)
            delta = replica_mean(delta, axis_name)
            outer_updates, outer_state = outer.update(delta, state.outer_state, state.anchor)
            anchor = optax.apply_updates(state.anchor, outer_updates)
            if reset_inner_state:
                inner_state = inner.init(anchor)
            to_anchor = jax.tree.map(lambda a, p: (a - p).astype(p.dtype), anchor, params)
            return to_anchor, inner_state, anchor, outer_state

        def local_step(operand):
            inner_updates, inner_state = operand
            return inner_updates, inner_state, state.anchor, state.outer_state

        new_updates, inner_state, anchor, outer_state = lax.cond(
            step % sync_every == 0, sync, local_step, (inner_updates, inner_state)
        )
        return new_updates, DilocoState(step, inner_state, anchor, outer_state)

    return optax.GradientTransformation(init_fn, update_fn)


def data_parallel(
    inner: optax.GradientTransformation, *, axis_name: AxisName = "replica"
) -> optax.GradientTransformation:
    """Synchronous data parallelism: average gradients over the replicas, then ``inner``.

    The ``ddp`` baseline: the same training code as DiLoCo with this transform in its place.
    """

    def update_fn(updates, state, params=None):
        del params
        return replica_mean(updates, axis_name), state

    mean_grads = optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
    return optax.chain(mean_grads, inner)


def replica_axes(opt_state: Any) -> Any:
    """A ``vmap`` ``in_axes``-style prefix tree for ``opt_state``: 0 per-replica, None shared.

    Every :class:`DilocoState` inside ``opt_state`` (also inside an ``optax.chain``) keeps its
    anchor, outer state and step once; everything else has a leading replica axis.
    """

    def axes(node):
        if isinstance(node, DilocoState):
            return DilocoState(step=None, inner_state=0, anchor=None, outer_state=None)
        return 0

    return jax.tree.map(axes, opt_state, is_leaf=lambda x: isinstance(x, DilocoState))


def find_anchor(opt_state: Any) -> optax.Params | None:
    """The anchor of the (first) :class:`DilocoState` in ``opt_state``, or None if there is none."""
    leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, DilocoState))
    for leaf in leaves:
        if isinstance(leaf, DilocoState):
            return leaf.anchor
    return None
