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

from diloco_jax import compress

AxisName = str | Sequence[str]


class SyncStats(NamedTuple):
    """Diagnostics of the last sync (zeros before the first one).

    Attributes:
      drift: per-replica. ``|anchor - params_r|``: how far the replica moved from the anchor
        during the round (the norm of its pseudo-gradient).
      cosine_to_mean: per-replica. Cosine between the replica's pseudo-gradient and the mean one.
      weight: per-replica. The replica's weight in the mean (0: left out).
      pairwise_cosine: shared. Mean cosine similarity over pairs of contributing replicas'
        pseudo-gradients (NaN unless ``diagnostics``; it costs one more all-reduce).
      outer_update_norm: shared. ``|anchor' - anchor|``.
      contributors: shared. How many replicas entered the mean.
      finite: per-replica. Whether the replica's pseudo-gradient was all finite (a non-finite one
        is left out of the mean and the replica restarts from the anchor with fresh inner state).
    """

    drift: jax.Array
    cosine_to_mean: jax.Array
    weight: jax.Array
    pairwise_cosine: jax.Array
    outer_update_norm: jax.Array
    contributors: jax.Array
    finite: jax.Array


class DilocoState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      step: int32 scalar, shared by all replicas (never has a replica axis, so the sync
        ``lax.cond`` stays a real branch under ``vmap``). Inner steps taken so far.
      inner_state: per-replica (``[R, ...]`` when replica-stacked). The inner optimizer's state,
        kept across syncs unless ``reset_inner_state``.
      anchor: shared. The outer ("global") parameters after the last sync.
      outer_state: shared. The outer optimizer's state (e.g. its Nesterov momentum).
      stats: :class:`SyncStats` of the last sync (per-replica and shared fields).
      at_anchor: per-replica bool: this step was a sync and the replica restarts from the anchor
        (:func:`apply_updates` then sets its parameters to the anchor exactly).
      residual: per-replica. With a codec and error feedback, what encoding this replica's
        pseudo-gradient lost, added to its next one; ``()`` otherwise.
    """

    step: jax.Array
    inner_state: optax.OptState
    anchor: optax.Params
    outer_state: optax.OptState
    stats: SyncStats
    at_anchor: jax.Array
    residual: Any = ()


def _names(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def replica_mean(tree: Any, axis_name: AxisName) -> Any:
    """Mean of ``tree`` over the replica axis, which may be several named axes.

    Several names are reduced one after the other (mean of equal-size group means equals the
    global mean). One ``pmean`` over a tuple mixing a ``vmap`` axis and a ``shard_map`` axis is not
    lowered by jax 0.10, so we never ask for one.
    """
    for name in _names(axis_name):
        tree = lax.pmean(tree, name)
    return tree


def replica_sum(tree: Any, axis_name: AxisName) -> Any:
    """Sum of ``tree`` over the replica axis (or axes); see :func:`replica_mean`."""
    for name in _names(axis_name):
        tree = lax.psum(tree, name)
    return tree


def compressed_replica_sum(tree: Any, axis_name: AxisName, codec: compress.Codec):
    """``(sum over replicas of tree, what this replica's encoding lost)`` with ``codec``.

    Leaves of at least ``codec.min_size`` values travel encoded through
    :func:`compress.compressed_sum` over the last axis name (the one between devices); they are
    summed in float32 over the other names first (replicas on the same device). Smaller leaves
    are summed in float32. The loss of a device's message is shared equally by its replicas.
    """
    names = _names(axis_name)
    leaves, treedef = jax.tree.flatten(tree)
    big = [i for i, x in enumerate(leaves) if x.size >= codec.min_size]
    out_sum = [None if i in big else replica_sum(x, axis_name) for i, x in enumerate(leaves)]
    out_lost = [None if i in big else jnp.zeros_like(x) for i, x in enumerate(leaves)]
    if big:
        flat = jnp.concatenate([leaves[i].reshape(-1).astype(jnp.float32) for i in big])
        if len(names) > 1:  # replicas on one device: summed in memory first
            flat = replica_sum(flat, names[:-1])
        total, loss = compress.compressed_sum(flat, names[-1], codec)
        if len(names) > 1:
            loss = loss / replica_sum(jnp.float32(1.0), names[:-1])
        start = 0
        for i in big:
            x, piece = leaves[i], slice(start, start + leaves[i].size)
            out_sum[i] = total[piece].reshape(x.shape).astype(x.dtype)
            out_lost[i] = loss[piece].reshape(x.shape).astype(x.dtype)
            start += x.size
    return jax.tree.unflatten(treedef, out_sum), jax.tree.unflatten(treedef, out_lost)


def _dot(a: Any, b: Any) -> jax.Array:
    return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _where(cond: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


def maskable(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` that takes an extra ``active`` argument: when False the step is skipped (zero
    updates, state unchanged). Used for stragglers' idle steps (Dynamic Local Updates)."""
    inner = optax.with_extra_args_support(inner)

    def update_fn(updates, state, params=None, *, active=True, **extra):
        new_updates, new_state = inner.update(updates, state, params, **extra)
        if active is True:
            return new_updates, new_state
        zeros = jax.tree.map(jnp.zeros_like, new_updates)
        return _where(active, new_updates, zeros), _where(active, new_state, state)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def _sync_stats(delta, mean_delta, weight, outer_norm, axis_name, diagnostics) -> SyncStats:
    norm = optax.tree.norm(delta)
    unit = jax.tree.map(lambda d: d / jnp.maximum(norm, 1e-30), delta)
    cosine = _dot(unit, mean_delta) / jnp.maximum(optax.tree.norm(mean_delta), 1e-30)
    included = weight > 0
    count = replica_sum(included.astype(jnp.float32), axis_name)
    pairwise = jnp.float32(jnp.nan)
    if diagnostics:
        # mean over pairs i != j of u_i . u_j = (|sum_i u_i|^2 - n) / (n (n - 1)), u unit vectors
        total = replica_sum(jax.tree.map(lambda u: jnp.where(included, u, 0.0), unit), axis_name)
        pairwise = (_dot(total, total) - count) / jnp.maximum(count * (count - 1), 1.0)
    finite = jnp.isfinite(norm)
    return SyncStats(norm, cosine, weight, pairwise, outer_norm, count, finite)


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    *,
    sync_every: int,
    axis_name: AxisName = "replica",
    reset_inner_state: bool = False,
    diagnostics: bool = False,
    codec: compress.Codec | None = None,
) -> optax.GradientTransformationExtraArgs:
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
      diagnostics: also compute the mean pairwise cosine of pseudo-gradients at each sync (one
        more all-reduce of parameter size).
      codec: how pseudo-gradients travel (:mod:`diloco_jax.compress`); None or ``"none"``:
        float32 ``pmean``. With ``codec.error_feedback`` each replica keeps what its encoding
        lost (``DilocoState.residual``) and adds it to its next pseudo-gradient.

    ``update(grads, state, params, *, active=True, weight=1.0, take_anchor=True)``, all optional
    and per replica: ``active=False`` skips this replica's inner step (a straggler idling);
    at a sync the mean is weighted, ``mean = sum_r w_r delta_r / sum_r w_r`` (``weight=0`` leaves
    a replica out: dropped); ``take_anchor=False`` leaves the replica on its own parameters
    instead of restarting from the new anchor. A replica whose pseudo-gradient holds NaN or Inf
    gets weight 0 and restarts from the anchor with a fresh inner state. If every weight is 0 the
    outer step is discarded (anchor and outer state stay) and replicas restart from the anchor.

    Returns:
      A transform whose ``update`` returns the inner update on ordinary steps and, on a sync step,
      ``anchor' - params``: ``optax.apply_updates`` lands a replica on the new anchor to within one
      float rounding, :func:`apply_updates` exactly (and also from NaN parameters).
    """
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    inner = maskable(inner)
    codec = None if codec is None or codec.name == "none" else codec
    if codec is not None:
        compress.validate(codec)
    feedback = codec is not None and codec.error_feedback

    def init_fn(params):
        zero = jnp.zeros([], jnp.float32)
        return DilocoState(
            step=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
            anchor=params,
            outer_state=outer.init(params),
            stats=SyncStats(zero, zero, zero, zero, zero, zero, jnp.ones([], bool)),
            at_anchor=jnp.zeros([], bool),
            residual=jax.tree.map(jnp.zeros_like, params) if feedback else (),
        )

    def update_fn(updates, state, params=None, *, active=True, weight=1.0, take_anchor=True):
        if params is None:
            raise ValueError("diloco needs params: call tx.update(grads, state, params)")
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, active=active)
        step = state.step + 1

        def sync(operand):
            inner_updates, inner_state = operand
            local = optax.apply_updates(params, inner_updates)
            delta = jax.tree.map(lambda a, p: a - p, state.anchor, local)
            finite = jnp.isfinite(optax.tree.norm(delta))  # NaN/Inf anywhere: leave it out
            w = jnp.where(finite, jnp.asarray(weight, jnp.float32), 0.0)
            residual = state.residual
            if codec is None:
                total_w = replica_mean(w, axis_name)
                weighted = replica_mean(
                    jax.tree.map(lambda d: jnp.where(w > 0, w * d, 0.0), delta), axis_name
                )
            else:
                sent = jax.tree.map(lambda d: jnp.where(w > 0, w * d, 0.0), delta)
                if feedback:  # a replica left out sends nothing and keeps its residual
                    sent = jax.tree.map(lambda s, e: jnp.where(w > 0, s + e, 0.0), sent, residual)
                total_w = replica_sum(w, axis_name)
                weighted, lost = compressed_replica_sum(sent, axis_name, codec)
                if feedback:
                    kept = jax.tree.map(lambda e: jnp.where(finite, e, 0.0), residual)
                    residual = _where(w > 0, lost, kept)
            mean_delta = jax.tree.map(lambda d: d / jnp.maximum(total_w, 1e-30), weighted)
            outer_updates, outer_state = outer.update(mean_delta, state.outer_state, state.anchor)
            anchor = optax.apply_updates(state.anchor, outer_updates)
            anyone = total_w > 0  # else: no outer step at all
            anchor = _where(anyone, anchor, state.anchor)
            outer_state = _where(anyone, outer_state, state.outer_state)
            restart = jnp.logical_or(take_anchor, ~finite)  # a bad replica always restarts
            reset = ~finite if not reset_inner_state else restart
            inner_state = _where(reset, inner.init(anchor), inner_state)
            to_anchor = jax.tree.map(lambda a, p: (a - p).astype(p.dtype), anchor, params)
            new_updates = _where(restart, to_anchor, inner_updates)
            outer_norm = optax.tree.norm(jax.tree.map(jnp.subtract, anchor, state.anchor))
            stats = _sync_stats(delta, mean_delta, w, outer_norm, axis_name, diagnostics)
            return new_updates, inner_state, anchor, outer_state, stats, restart, residual

        def local_step(operand):
            inner_updates, inner_state = operand
            stay = jnp.zeros([], bool)
            return (inner_updates, inner_state, state.anchor, state.outer_state, state.stats,
                    stay, state.residual)  # fmt: skip

        new_updates, *rest = lax.cond(
            step % sync_every == 0, sync, local_step, (inner_updates, inner_state)
        )
        return new_updates, DilocoState(step, *rest)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
    return optax.with_extra_args_support(optax.chain(mean_grads, inner))


def replica_axes(opt_state: Any) -> Any:
    """A ``vmap`` ``in_axes``-style prefix tree for ``opt_state``: 0 per-replica, None shared.

    Every :class:`DilocoState` inside ``opt_state`` (also inside an ``optax.chain``) keeps its
    anchor, outer state and step once; everything else has a leading replica axis.
    """

    def axes(node):
        if isinstance(node, DilocoState):
            stats = SyncStats(0, 0, 0, None, None, None, 0)
            return DilocoState(None, 0, None, None, stats, at_anchor=0, residual=0)
        return 0

    return jax.tree.map(axes, opt_state, is_leaf=lambda x: isinstance(x, DilocoState))


def apply_updates(params: optax.Params, updates: optax.Updates, opt_state: Any) -> Any:
    """``optax.apply_updates``, except that a replica restarting from the anchor at a sync gets
    the anchor exactly (also when its own parameters hold NaN, where ``p + (anchor - p)`` would
    not). Use it in place of ``optax.apply_updates`` with :func:`diloco`."""
    new_params = optax.apply_updates(params, updates)
    state = find_diloco_state(opt_state)
    if state is None:
        return new_params
    return jax.tree.map(
        lambda a, p: jnp.where(state.at_anchor, a.astype(p.dtype), p), state.anchor, new_params
    )


def find_diloco_state(opt_state: Any) -> DilocoState | None:
    """The (first) :class:`DilocoState` inside ``opt_state``, or None if there is none."""
    leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, DilocoState))
    return next((leaf for leaf in leaves if isinstance(leaf, DilocoState)), None)


def find_anchor(opt_state: Any) -> optax.Params | None:
    """The anchor of the (first) :class:`DilocoState` in ``opt_state``, or None if there is none."""
    state = find_diloco_state(opt_state)
    return None if state is None else state.anchor
