"""DiLoCo as an optax transform (Douillard et al., 2023, arXiv 2311.08105, Algorithm 1).

Each replica ``r`` runs an inner optimizer on its own data. Every ``sync_every`` inner steps the
replicas average their pseudo-gradients and an outer optimizer moves the shared anchor::

    delta_r   = anchor - params_r                      # pseudo-gradient (points uphill)
    delta     = mean_r delta_r                         # an Exchange (diloco_jax.exchange)
    anchor'   = anchor + outer.update(delta, outer_state, anchor)
    params_r' = anchor'                                # every replica restarts from the anchor

With outer ``sgd(1.0)`` the anchor becomes the plain average of the replicas' parameters
(FedAvg); the paper's outer optimizer is Nesterov SGD, lr 0.7, momentum 0.9.

Variants, each a small piece chosen by an argument:

* how the mean travels: float32, a codec, or DCT momentum (:mod:`diloco_jax.exchange`);
* Streaming DiLoCo (arXiv 2501.18512, :mod:`diloco_jax.fragments`): ``F`` fragments synced in
  turn, each with its own outer state; the merged fragment lands ``overlap`` steps after its
  sync started, mixed as ``params_f = mix * params_f + (1 - mix) * anchor_f``;
* the outer step overlapped with the next round (Kale et al., arXiv 2502.12996): ``delayed``
  applies the previous sync's mean (its all-reduce ran during the round); ``eager`` applies
  ``mean^(t-1) + share_r^(t) - share_r^(t-1)``, replica ``r``'s fresh share of the mean in place
  of its stale one, so each replica keeps its own anchor and outer state.

The transform is written for one replica: it must run under a named axis (``jax.vmap(...,
axis_name=...)`` or ``jax.shard_map``) that spans the replicas.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from diloco_jax import compress, dct, exchange, fragments
from diloco_jax.diagnostics import SyncStats, sync_stats
from diloco_jax.exchange import AxisName, replica_mean, replica_sum

OUTER_MODES = ("sync", "delayed", "eager")


class Streaming(NamedTuple):
    """Streaming DiLoCo: ``fragments`` (F), ``overlap`` (tau, inner steps between a fragment's
    sync and its landing, ``< sync_every / F``) and ``mix`` (alpha, the local parameters' weight
    when the merged fragment lands). ``Streaming()`` is plain DiLoCo."""

    fragments: int = 1
    overlap: int = 0
    mix: float = 0.0


class DilocoState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      step: int32 scalar, shared by all replicas (never has a replica axis, so the sync
        ``lax.cond`` stays a real branch under ``vmap``). Inner steps taken so far.
      inner_state: per-replica (``[R, ...]`` when replica-stacked). The inner optimizer's state,
        kept across syncs unless ``reset_inner_state``.
      anchor: shared (per-replica with eager updates). The outer ("global") parameters.
      outer_state: shared (per-replica with eager updates). A tuple of the outer optimizer's
        states, one per fragment (over the list of that fragment's leaves).
      stats: :class:`SyncStats` of the last sync (per-replica and shared fields).
      at_anchor: per-replica, a tuple of one bool per parameter leaf: this step landed the leaf
        on the anchor (:func:`apply_updates` then sets it to the anchor exactly).
      residual: per-replica, a tuple (one per fragment) of the exchange's state: what a codec's
        encoding lost (error feedback) or the DCT momentum; ``()`` entries when stateless.
      pending: shared, ``delayed``/``eager`` only: the mean of the last sync, applied at the next.
      last_share: per-replica, ``eager`` only: this replica's share of ``pending``.
    """

    step: jax.Array
    inner_state: optax.OptState
    anchor: optax.Params
    outer_state: optax.OptState
    stats: SyncStats
    at_anchor: tuple
    residual: tuple = ()
    pending: Any = ()
    last_share: Any = ()


class EagerDilocoState(DilocoState):
    """:class:`DilocoState` of eager updates: the anchor, outer state and stats are per replica
    (each replica applies its own proxy of the mean)."""


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


class _Round(NamedTuple):
    """What a step's sync and landing change, as lists of leaves (see :class:`DilocoState`)."""

    updates: list
    inner_state: Any
    anchor: list
    outer_state: tuple
    stats: SyncStats
    at_anchor: tuple
    residual: tuple
    pending: Any
    last_share: Any


def _replace_at(values: list, idx: list[int], new: list) -> list:
    out = list(values)
    for i, v in zip(idx, new, strict=True):
        out[i] = v
    return out


def _make_exchange(axis_name, codec, dct_config) -> exchange.Exchange:
    if dct_config is not None:
        return exchange.dct_momentum(axis_name, dct_config)
    if codec is not None:
        return exchange.encoded(axis_name, codec)
    return exchange.plain(axis_name)


def _check_options(sync_every, streaming, outer_mode, codec, dct_config, reset_inner_state):
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    f, tau, mix = streaming
    if f < 1:
        raise ValueError(f"streaming fragments must be >= 1, got {f}")
    period = fragments.period(sync_every, f)
    if not 0 <= tau < period:
        raise ValueError(f"streaming overlap {tau} must be in [0, sync_every / fragments = "
                         f"{period})")  # fmt: skip
    if not 0 <= mix < 1:
        raise ValueError(f"streaming mix {mix} must be in [0, 1)")
    if outer_mode not in OUTER_MODES:
        raise ValueError(f"outer mode {outer_mode!r} is not one of {OUTER_MODES}")
    if outer_mode != "sync" and (f > 1 or tau > 0):
        raise ValueError(f"outer mode {outer_mode!r} does not combine with streaming")
    if reset_inner_state and f > 1:
        raise ValueError("reset_inner_state does not combine with streaming fragments")
    if codec is not None and dct_config is not None:
        raise ValueError("choose a codec or DCT momentum, not both")
    if codec is not None:
        compress.validate(codec)
    if dct_config is not None:
        dct.validate(dct_config)


def _start_sync(f, rnd: _Round, *, params, groups, weight, ex, outer, mode, axis_name,
                diagnostics) -> _Round:  # fmt: skip
    """Fragment ``f``'s pseudo-gradient goes into the exchange; the outer step moves its anchor
    (by this mean, or with ``delayed``/``eager`` by the previous one)."""
    idx = groups[f]
    local = [(params[i] + rnd.updates[i]).astype(params[i].dtype) for i in idx]
    anchor = [rnd.anchor[i] for i in idx]
    delta = [a - p for a, p in zip(anchor, local, strict=True)]
    finite = jnp.isfinite(optax.tree.norm(delta))  # NaN/Inf anywhere: leave it out
    w = jnp.where(finite, jnp.asarray(weight, jnp.float32), 0.0)
    mean, residual_f, total_w = ex.mean(delta, w, finite, rnd.residual[f])
    pending, last_share, applied = rnd.pending, rnd.last_share, mean
    if mode == "delayed":  # this mean arrives during the next round; apply the last one now
        applied, pending = rnd.pending, mean
    elif mode == "eager":  # my fresh share in place of my stale one in the last mean
        share_w = replica_sum(w, axis_name)
        share = [jnp.where(w > 0, w * d, 0.0) / jnp.maximum(share_w, 1e-30) for d in delta]
        applied = [
            m + s - old for m, s, old in zip(rnd.pending, share, rnd.last_share, strict=True)
        ]
        pending, last_share = mean, share
    outer_updates, outer_f = outer.update(applied, rnd.outer_state[f], anchor)
    anyone = total_w > 0  # else: no outer step at all
    new_anchor = _where(anyone, optax.apply_updates(anchor, outer_updates), anchor)
    outer_f = _where(anyone, outer_f, rnd.outer_state[f])
    if mode != "sync":
        pending = _where(anyone, pending, rnd.pending)
        last_share = _where(anyone, last_share, rnd.last_share)
    outer_norm = optax.tree.norm(jax.tree.map(jnp.subtract, new_anchor, anchor))
    return rnd._replace(
        anchor=_replace_at(rnd.anchor, idx, new_anchor),
        outer_state=(*rnd.outer_state[:f], outer_f, *rnd.outer_state[f + 1 :]),
        stats=sync_stats(delta, mean, w, outer_norm, axis_name, diagnostics),
        residual=(*rnd.residual[:f], residual_f, *rnd.residual[f + 1 :]),
        pending=pending,
        last_share=last_share,
    )


def _land(f, rnd: _Round, *, params, groups, take_anchor, mix, reset_inner_state, inner,
          treedef) -> _Round:  # fmt: skip
    """Fragment ``f``'s merged value lands: ``params_f = mix * local_f + (1 - mix) * anchor_f``
    (``take_anchor=False``: the replica keeps its own). A replica whose last pseudo-gradient was
    not finite restarts every leaf from the anchor with a fresh inner state."""
    members, bad = set(groups[f]), ~rnd.stats.finite
    restart = jnp.logical_or(take_anchor, bad)
    updates, at_anchor = [], []
    for i, (p, u, a) in enumerate(zip(params, rnd.updates, rnd.anchor, strict=True)):
        target, go, exact = a, bad, bad
        if i in members:
            go, exact = restart, restart
            if mix > 0:
                target = jnp.where(bad, a, mix * (p + u) + (1 - mix) * a)
                exact = bad
        updates.append(jnp.where(go, (target - p).astype(p.dtype), u))
        at_anchor.append(exact)
    reset = restart if reset_inner_state else bad
    fresh = inner.init(jax.tree.unflatten(treedef, rnd.anchor))
    inner_state = _where(reset, fresh, rnd.inner_state)
    return rnd._replace(updates=updates, inner_state=inner_state, at_anchor=tuple(at_anchor))


def _maybe(on: jax.Array, which: jax.Array, branches: list, rnd: _Round) -> _Round:
    """``branches[which](rnd)`` if ``on`` else ``rnd``. ``on`` and ``which`` derive from the
    shared step, so under ``vmap`` this stays a branch (not a select running both sides)."""

    def run(r):
        return branches[0](r) if len(branches) == 1 else lax.switch(which, branches, r)

    return lax.cond(on, run, lambda r: r, rnd)


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    *,
    sync_every: int,
    axis_name: AxisName = "replica",
    reset_inner_state: bool = False,
    diagnostics: bool = False,
    codec: compress.Codec | None = None,
    dct_config: dct.DctConfig | None = None,
    streaming: Streaming | None = None,
    outer_mode: str = "sync",
    fragment_of=fragments.strided,
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo: ``sync_every`` local steps of ``inner``, then one ``outer`` step on the anchor.

    Args:
      inner: the per-replica optimizer (the paper: AdamW).
      outer: the optimizer of the anchor, fed the replica-mean pseudo-gradient (the paper:
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
      sync_every: inner steps between syncs (the paper's H; of each fragment when streaming).
      axis_name: the named axis (or axes, reduced in order) spanning the replicas.
      reset_inner_state: re-initialise the inner state from the new anchor at every sync. The
        paper keeps it; note that a reset also restarts any step count inside ``inner`` (and so its
        learning-rate schedule).
      diagnostics: also compute the mean pairwise cosine of pseudo-gradients at each sync (one
        more all-reduce of parameter size).
      codec: how pseudo-gradients travel (:mod:`diloco_jax.compress`); None or ``"none"``:
        float32. With ``codec.error_feedback`` each replica keeps what its encoding lost
        (``DilocoState.residual``) and adds it to its next pseudo-gradient.
      dct_config: exchange DCT momentum instead (:func:`diloco_jax.exchange.dct_momentum`).
      streaming: :class:`Streaming` fragments, overlap and mix (None: plain DiLoCo).
      outer_mode: ``sync`` (the paper), ``delayed`` or ``eager`` (see the module docstring).
      fragment_of: ``params -> fragment of each leaf`` (default :func:`fragments.strided`).

    ``update(grads, state, params, *, active=True, weight=1.0, take_anchor=True)``, all optional
    and per replica: ``active=False`` skips this replica's inner step (a straggler idling);
    at a sync the mean is weighted, ``mean = sum_r w_r delta_r / sum_r w_r`` (``weight=0`` leaves
    a replica out: dropped); ``take_anchor=False`` leaves the replica on its own parameters
    instead of restarting from the new anchor. A replica whose pseudo-gradient holds NaN or Inf
    gets weight 0 and restarts from the anchor with a fresh inner state. If every weight is 0 the
    outer step is discarded (anchor and outer state stay) and replicas restart from the anchor.

    Returns:
      A transform whose ``update`` returns the inner update on ordinary steps and, where a
      replica lands on the anchor, ``anchor' - params``: ``optax.apply_updates`` lands it to
      within one float rounding, :func:`apply_updates` exactly (and also from NaN parameters).
    """
    codec = None if codec is None or codec.name == "none" else codec
    streaming = Streaming() if streaming is None else Streaming(*streaming)
    _check_options(sync_every, streaming, outer_mode, codec, dct_config, reset_inner_state)
    inner = maskable(inner)
    count, overlap, mix = streaming
    ex = _make_exchange(axis_name, codec, dct_config)
    state_type = EagerDilocoState if outer_mode == "eager" else DilocoState

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        groups = fragments.groups(fragment_of(params, count), count)
        zero, zeros = jnp.zeros([], jnp.float32), [jnp.zeros_like(x) for x in leaves]
        return state_type(
            step=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
            anchor=params,
            outer_state=tuple(outer.init([leaves[i] for i in idx]) for idx in groups),
            stats=SyncStats(zero, zero, zero, zero, zero, zero, jnp.ones([], bool)),
            at_anchor=tuple(jnp.zeros([], bool) for _ in leaves),
            residual=tuple(ex.init([leaves[i] for i in idx]) for idx in groups),
            pending=zeros if outer_mode != "sync" else (),
            last_share=zeros if outer_mode == "eager" else (),
        )

    def update_fn(updates, state, params=None, *, active=True, weight=1.0, take_anchor=True):
        if params is None:
            raise ValueError("diloco needs params: call tx.update(grads, state, params)")
        inner_updates, inner_state = inner.update(updates, state.inner_state, params, active=active)
        step = state.step + 1
        leaves, treedef = jax.tree.flatten(params)
        groups = fragments.groups(fragment_of(params, count), count)
        rnd = _Round(jax.tree.leaves(inner_updates), inner_state, jax.tree.leaves(state.anchor),
                     state.outer_state, state.stats, tuple(jnp.zeros([], bool) for _ in leaves),
                     state.residual, state.pending, state.last_share)  # fmt: skip
        start = functools.partial(
            _start_sync, params=leaves, groups=groups, weight=weight, ex=ex, outer=outer,
            mode=outer_mode, axis_name=axis_name, diagnostics=diagnostics,
        )  # fmt: skip
        land = functools.partial(
            _land, params=leaves, groups=groups, take_anchor=take_anchor, mix=mix,
            reset_inner_state=reset_inner_state, inner=inner, treedef=treedef,
        )  # fmt: skip
        on, which = fragments.starting(step, sync_every, count)
        if overlap == 0:  # the merged fragment lands in the step its sync starts
            rnd = _maybe(
                on, which, [lambda r, f=f: land(f, start(f, r)) for f in range(count)], rnd
            )
        else:
            rnd = _maybe(on, which, [functools.partial(start, f) for f in range(count)], rnd)
            on, which = fragments.landing(step, sync_every, count, overlap)
            rnd = _maybe(on, which, [functools.partial(land, f) for f in range(count)], rnd)
        new_state = state_type(
            step, rnd.inner_state, jax.tree.unflatten(treedef, rnd.anchor), rnd.outer_state,
            rnd.stats, rnd.at_anchor, rnd.residual, rnd.pending, rnd.last_share,
        )  # fmt: skip
        return jax.tree.unflatten(treedef, rnd.updates), new_state

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


def _is_state(x) -> bool:
    return isinstance(x, DilocoState)


def replica_axes(opt_state: Any) -> Any:
    """A ``vmap`` ``in_axes``-style prefix tree for ``opt_state``: 0 per-replica, None shared.

    Every :class:`DilocoState` inside ``opt_state`` (also inside an ``optax.chain``) keeps its
    anchor, outer state, pending mean and step once (:class:`EagerDilocoState`: only the step and
    the pending mean); everything else has a leading replica axis.
    """

    def axes(node):
        if isinstance(node, EagerDilocoState):
            stats = SyncStats(0, 0, 0, None, 0, None, 0)
            return EagerDilocoState(None, 0, 0, 0, stats, 0, residual=0, pending=None,
                                    last_share=0)  # fmt: skip
        if isinstance(node, DilocoState):
            stats = SyncStats(0, 0, 0, None, None, None, 0)
            return DilocoState(None, 0, None, None, stats, 0, residual=0, pending=None,
                               last_share=0)  # fmt: skip
        return 0

    return jax.tree.map(axes, opt_state, is_leaf=_is_state)


def apply_updates(params: optax.Params, updates: optax.Updates, opt_state: Any) -> Any:
    """``optax.apply_updates``, except that a replica landing on the anchor at a sync gets the
    anchor exactly (also when its own parameters hold NaN, where ``p + (anchor - p)`` would
    not). Use it in place of ``optax.apply_updates`` with :func:`diloco`."""
    new_params = optax.apply_updates(params, updates)
    state = find_diloco_state(opt_state)
    if state is None:
        return new_params
    leaves, treedef = jax.tree.flatten(new_params)
    anchor = jax.tree.leaves(state.anchor)
    landed = [jnp.where(m, a.astype(p.dtype), p)
              for a, p, m in zip(anchor, leaves, state.at_anchor, strict=True)]  # fmt: skip
    return jax.tree.unflatten(treedef, landed)


def find_diloco_state(opt_state: Any) -> DilocoState | None:
    """The (first) :class:`DilocoState` inside ``opt_state``, or None if there is none."""
    leaves = jax.tree.leaves(opt_state, is_leaf=_is_state)
    return next((leaf for leaf in leaves if _is_state(leaf)), None)


def find_anchor(opt_state: Any) -> optax.Params | None:
    """The anchor of the (first) :class:`DilocoState` in ``opt_state``, or None if there is none
    (per replica, ``[R, ...]`` when stacked, for :class:`EagerDilocoState`)."""
    state = find_diloco_state(opt_state)
    return None if state is None else state.anchor
