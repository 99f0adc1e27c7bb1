"""DiLoCo (Douillard et al., 2023, arXiv 2311.08105, Algorithm 1) over a replica-stacked state.

Each replica ``r`` runs an inner optimizer on its own data. Every ``sync_every`` inner steps the
replicas average their pseudo-gradients and an outer optimizer moves the shared anchor::

    delta_r   = anchor - params_r                      # pseudo-gradient (points uphill)
    Delta     = sum_r w_r delta_r / sum_r w_r          # an Exchange (diloco_jax.algorithm.exchange)
    anchor'   = anchor + outer.update(Delta, outer_state, anchor)
    params_r' = anchor'                                # every replica restarts from the anchor

With outer ``sgd(1.0)`` the anchor becomes the plain average of the replicas' parameters
(FedAvg); the paper's outer optimizer is Nesterov SGD, lr 0.7, momentum 0.9. Inner and outer
optimizers are any optax transforms.

The state (:class:`DilocoState`) holds the replicas' parameters itself; which fields are per
replica and which shared is declared once (:meth:`Diloco.kinds`) and every layout derives from
it (:mod:`diloco_jax.algorithm.state`). A sync assigns the anchor to the replicas directly.

Variants are pieces chosen by argument (:func:`~diloco_jax.diloco`, in ``build.py``): how the
mean travels (:mod:`.exchange`), when fragments sync and land
(:class:`~diloco_jax.algorithm.plan.SyncPlan`, Streaming DiLoCo), when the outer step applies
(:mod:`diloco_jax.algorithm.timing`). :meth:`Diloco.update` is written for one replica
and runs under a named axis spanning the replicas (``jax.vmap(..., axis_name=...)`` or
``jax.shard_map``).

Dtypes: parameters, anchor, pending means and the outer state (as the outer optimizer's ``init``
makes it from the anchor) keep the parameters' dtype (float32, bfloat16, float16 or float64);
the mean is accumulated in ``promote(float32, dtype)`` and then cast to it; sync statistics are
float32 (``finite`` bool); the step is int32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from diloco_jax.algorithm import exchange, fragments, moments
from diloco_jax.algorithm import state as state_lib
from diloco_jax.algorithm.diagnostics import SyncStats, sync_stats, zero_stats
from diloco_jax.algorithm.exchange import AxisName
from diloco_jax.algorithm.plan import SyncPlan
from diloco_jax.algorithm.state import PER_REPLICA, SHARED
from diloco_jax.algorithm.timing import Timing


class DilocoState(NamedTuple):
    """The replica-stacked state of DiLoCo: which fields are per replica and which shared is
    :attr:`Diloco.kinds <diloco_jax.Diloco.kinds>`.

    Attributes:
      step: int32 scalar, shared (never a replica axis, so the sync ``lax.cond`` stays a branch
        under ``vmap``). Inner steps taken so far.
      params: per replica ``[R, ...]``: each replica's parameters.
      inner_state: per replica: the inner optimizer's state, kept across syncs unless
        ``reset_inner_state``.
      anchor: shared (per replica with eager updates): the outer ("global") parameters.
      outer_state: shared (per replica with eager updates): one outer optimizer state per
        fragment, over the list of that fragment's leaves.
      exchange_state: per replica: one per fragment, the exchange's state (error-feedback
        residual, DCT momentum, or ``()``).
      timing_state: the outer timing piece's state (``()`` for ``sync``), with its own kinds.
      healthy: per replica, bool scalar: the replica's last pseudo-gradient was finite (else it
        restarts from the anchor with a fresh inner state when its fragment lands).
      base: per replica, with ``late_merge`` (else ``()``): the anchor this replica last
        restarted from (parameters' dtype); its pseudo-gradient is measured from it, so a
        replica that missed syncs merges the work of all its rounds since.
    """

    step: jax.Array
    params: Any
    inner_state: Any
    anchor: Any
    outer_state: Any  # a tuple of the fragments' states (a list while a step builds it)
    exchange_state: Any
    timing_state: Any
    healthy: jax.Array
    base: Any


def _delta(start: list, params: list, weight) -> tuple[list, jax.Array, jax.Array]:
    """``(delta, w, finite)``: a replica's pseudo-gradient ``start - params``, its weight (0
    where the pseudo-gradient holds NaN or Inf: left out) and whether it is finite."""
    delta = [a - p for a, p in zip(start, params, strict=True)]
    finite = jnp.isfinite(optax.tree.norm(delta))  # NaN/Inf anywhere: leave it out
    return delta, jnp.where(finite, jnp.asarray(weight, jnp.float32), 0.0), finite


def _where(cond: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


class _Round(NamedTuple):
    """What a step's sync and landing change; parameters as lists of leaves."""

    params: list
    inner_state: Any
    anchor: list
    outer_state: tuple
    exchange_state: tuple
    timing_state: Any
    healthy: jax.Array
    stats: SyncStats
    base: list


def _set(values, idx: list[int], new: list) -> Any:  # a list or tuple, as ``values``
    out = list(values)
    for i, v in zip(idx, new, strict=True):
        out[i] = v
    return type(values)(out)


def _same_types(fn):
    """``fn(rnd)`` with every output leaf cast back to its input's dtype, so every branch of
    the sync ``lax.cond`` returns the same types whatever the parameters' dtype."""

    def wrapped(rnd):
        old, treedef = jax.tree.flatten(rnd)
        new = jax.tree.leaves(fn(rnd))
        return jax.tree.unflatten(
            treedef, [jnp.asarray(n, o.dtype) for n, o in zip(new, old, strict=True)]
        )

    return wrapped


def _maybe(on: jax.Array, which: jax.Array, branches: list, rnd: _Round) -> _Round:
    """``branches[which](rnd)`` if ``on`` else ``rnd``. ``on`` and ``which`` derive from the
    shared step, so under ``vmap`` this stays a branch (not a select running both sides)."""
    branches = [_same_types(b) for b in branches]

    def run(r):
        return branches[0](r) if len(branches) == 1 else lax.switch(which, branches, r)

    return lax.cond(on, run, lambda r: r, rnd)


class Diloco(NamedTuple):
    """The DiLoCo algorithm: its pieces (inner and outer optimizers, sync plan, exchange,
    outer timing), built by :func:`~diloco_jax.diloco`, and the methods a training loop calls.

    :meth:`update` is written for one replica, under a named axis spanning the replicas;
    :func:`~diloco_jax.init_replicas` builds the replica-stacked state from :meth:`init` and
    :attr:`kinds`, and :meth:`outer_params` gives the parameters to evaluate.
    """

    inner: optax.GradientTransformationExtraArgs
    outer: optax.GradientTransformation
    plan: SyncPlan
    exchange: exchange.Exchange
    timing: Timing
    axis_name: AxisName
    mix: float
    reset_inner_state: bool
    diagnostics: bool
    fragment_of: Callable
    moment_sync: moments.MomentSync = moments.MomentSync()
    late_merge: bool = False
    merge: Any = None  # the robust.Merge its exchange applies (None: the weighted mean); a
    # syncer of learners merges their pushes with it too

    @property
    def kinds(self) -> DilocoState:
        """Which fields of the state are per replica and which shared.

        A :class:`~diloco_jax.DilocoState` whose fields hold :data:`~diloco_jax.PER_REPLICA`
        or :data:`~diloco_jax.SHARED`, the one declaration every layout (vmap axes, shard_map
        specs, checkpoints, elastic restarts) derives from."""
        own = PER_REPLICA in (self.timing.anchor_kind, self.exchange.anchor_kind)
        anchor = PER_REPLICA if own else SHARED
        return state_lib.declare(DilocoState, step=SHARED, params=PER_REPLICA,
                                 inner_state=PER_REPLICA, anchor=anchor, outer_state=anchor,
                                 exchange_state=PER_REPLICA, timing_state=self.timing.kinds,
                                 healthy=PER_REPLICA, base=PER_REPLICA)  # fmt: skip

    def _groups(self, params) -> list[list[int]]:
        return fragments.groups(self.fragment_of(params, self.plan.fragments), self.plan.fragments)

    def init(self, params) -> DilocoState:
        """The state of one replica starting from ``params``
        (:func:`~diloco_jax.init_replicas` stacks it for every replica).

        Args:
          params: the initial parameters, a pytree of float arrays.

        Returns:
          One replica's :class:`~diloco_jax.DilocoState`, at step 0, with the anchor equal to
          ``params`` and fresh inner, outer and exchange states.
        """
        leaves = jax.tree.leaves(params)
        parts = [[leaves[i] for i in idx] for idx in self._groups(params)]
        return DilocoState(
            step=jnp.zeros([], jnp.int32),
            params=params,
            inner_state=self.inner.init(params),
            anchor=params,
            outer_state=tuple(self.outer.init(p) for p in parts),
            exchange_state=tuple(self.exchange.init(p) for p in parts),
            timing_state=self.timing.init(leaves),
            healthy=jnp.ones([], bool),
            base=params if self.late_merge else (),
        )

    def outer_params(self, stacked: DilocoState) -> Any:
        """The parameters to evaluate.

        Args:
          stacked: the replica-stacked state.

        Returns:
          The anchor (with eager outer steps and gossip, where every replica keeps its own,
          the replicas' mean anchor).
        """
        if self.kinds.anchor == PER_REPLICA:
            return jax.tree.map(lambda x: x.mean(axis=0).astype(x.dtype), stacked.anchor)
        return stacked.anchor

    def _start(self, f: int, rnd: _Round, *, groups, weight, outer_scale) -> _Round:
        """Fragment ``f``'s pseudo-gradient goes into the exchange; the outer step moves its
        anchor (by this mean or, with delayed/eager timing, as the timing piece says)."""
        idx = groups[f]
        anchor = [rnd.anchor[i] for i in idx]
        start = [rnd.base[i] for i in idx] if self.late_merge else anchor
        delta, w, finite, mean, ex_f, total_w = self._contribute(
            start, [rnd.params[i] for i in idx], anchor, weight, rnd.exchange_state[f]
        )
        applied, timing_state = self.timing.apply(mean, delta, w, rnd.timing_state)
        # every replica holds the same scale: their max is it, and is not per replica (vmap)
        for name in exchange.names(self.axis_name):
            outer_scale = lax.pmax(jnp.asarray(outer_scale, jnp.float32), name)
        anyone = total_w > 0  # else: no outer step at all
        new_anchor, outer_f = self.outer_step(applied, anchor, rnd.outer_state[f], outer_scale,
                                              anyone)  # fmt: skip
        moved = [(n - a).astype(jnp.float32) for n, a in zip(new_anchor, anchor, strict=True)]
        return rnd._replace(
            anchor=_set(rnd.anchor, idx, new_anchor),
            outer_state=_set(rnd.outer_state, [f], [outer_f]),
            exchange_state=_set(rnd.exchange_state, [f], [ex_f]),
            timing_state=_where(anyone, timing_state, rnd.timing_state),
            healthy=finite,
            stats=sync_stats(
                delta, mean, w, optax.tree.norm(moved), self.axis_name, self.diagnostics
            ),
        )

    def _contribute(self, start: list, params: list, anchor: list, weight, exchange_state):
        """The replicas' weighted mean pseudo-gradient of one fragment (``start - params``; a
        replica whose own is not finite is left out): ``(delta, w, finite, mean, exchange_state,
        total_w)``, ``mean`` in the anchor's dtypes."""
        delta, w, finite = _delta(start, params, weight)
        mean, ex_f, total_w = self.exchange.mean(delta, w, finite, exchange_state, anchor=anchor)
        mean = [m.astype(a.dtype) for m, a in zip(mean, anchor, strict=True)]
        return delta, w, finite, mean, ex_f, total_w

    def contribution(self, state: DilocoState, weight=1.0, fragment: int = 0):
        """One replica's part of a sync whose outer step is taken elsewhere (a syncer of
        independent learners, :mod:`diloco_jax.learners`): ``(state, mean, total_w)``, where
        ``mean`` is the weighted mean pseudo-gradient of the replicas on the replica axis (as
        a list of the leaves of ``fragment``, the same on every replica), ``total_w`` their mean
        weight (0: nobody's was finite) and ``state`` has the exchange's new state of that
        fragment and ``healthy``: a sync's start (``_start``) without its outer step. ``sync``
        timing, a shared anchor; Streaming DiLoCo's fragment ``f`` (plain DiLoCo: the one
        fragment, every leaf)."""
        anchor, start, params = self._fragment(state, fragment)
        _, w, finite, mean, ex, _ = self._contribute(
            start, params, anchor, weight, state.exchange_state[fragment]
        )
        exchange_state = _set(state.exchange_state, [fragment], [ex])
        # the mean weight, whether the exchange's own total is a sum (a codec's) or a mean
        total_w = exchange.replica_mean(w, self.axis_name)
        return state._replace(exchange_state=exchange_state, healthy=finite), mean, total_w

    def _fragment(self, state: DilocoState, fragment: int) -> tuple[list, list, list]:
        """``(anchor, start, params)``: the leaves of ``fragment`` (``start``: where its
        pseudo-gradient is measured from, the anchor or with ``late_merge`` the base)."""
        idx = self._groups(state.params)[fragment]

        def pick(tree) -> list:
            leaves = jax.tree.leaves(tree)
            return [leaves[i] for i in idx]

        anchor = pick(state.anchor)
        return anchor, pick(state.base) if self.late_merge else anchor, pick(state.params)

    def messages(self, state: DilocoState, weight=1.0, fragment: int = 0):
        """:meth:`contribution` with the mean left undecoded, for an exchange that has messages
        (:attr:`Exchange.messages <diloco_jax.algorithm.exchange.Exchange>`: DCT momentum,
        SparseLoCo) and a syncer that decodes them: ``(state, (small, messages_R, w_R),
        total_w)``, where ``small`` lists the fragment's leaves with the replicas' weighted mean
        of those under the exchange's ``min_size`` (anchor dtypes; None for the others),
        ``messages_R`` every replica's message of the others in replica order (None if none),
        ``w_R`` their weights and ``total_w`` their mean weight (0: nobody's was finite), all
        the same on every replica."""
        if self.exchange.messages is None:
            raise ValueError("this exchange sends no messages of its own: use contribution")
        anchor, start, params = self._fragment(state, fragment)
        delta, w, finite = _delta(start, params, weight)
        small, messages_R, w_R, ex, total_w = self.exchange.messages(
            delta, w, finite, state.exchange_state[fragment]
        )
        small = [None if m is None else m.astype(a.dtype)
                 for m, a in zip(small, anchor, strict=True)]  # fmt: skip
        exchange_state = _set(state.exchange_state, [fragment], [ex])
        state = state._replace(exchange_state=exchange_state, healthy=finite)
        return state, (small, messages_R, w_R), total_w / w_R.shape[0]

    def restart(self, state: DilocoState, anchor, fragment: int | None = None) -> DilocoState:
        """One replica after an outer step taken elsewhere (:meth:`contribution`): the new
        ``anchor`` lands as a sync lands here (every replica restarts from it, or with ``mix``
        mixes it in; one whose pseudo-gradient was not finite with a fresh inner state).
        ``fragment``: only that fragment's anchor is new, ``anchor`` the list of its leaves
        (Streaming DiLoCo); None: ``anchor`` is the whole tree and every fragment lands."""
        leaves, treedef = jax.tree.flatten(state.params)
        groups = self._groups(state.params)
        if fragment is None:
            new, landing = jax.tree.leaves(anchor), range(len(groups))
        else:
            new = _set(jax.tree.leaves(state.anchor), groups[fragment], list(anchor))
            landing = range(fragment, fragment + 1)
        rnd = _Round(leaves, state.inner_state, new, state.outer_state, state.exchange_state,
                     state.timing_state, state.healthy, zero_stats(),
                     jax.tree.leaves(state.base))  # fmt: skip
        for f in landing:
            rnd = self._land(f, rnd, groups=groups, take_anchor=True, treedef=treedef)
        return state._replace(
            params=jax.tree.unflatten(treedef, rnd.params), inner_state=rnd.inner_state,
            anchor=jax.tree.unflatten(treedef, rnd.anchor), healthy=rnd.healthy,
            base=jax.tree.unflatten(treedef, rnd.base) if self.late_merge else ())  # fmt: skip

    def land_mean(self, state: DilocoState, mean, learners: int, outer_scale=1.0) -> DilocoState:
        """One replica after an outer step taken here on a ``mean`` merged elsewhere (a syncer's,
        of ``learners`` learners each with the replicas on this axis; ``eager`` timing, where a
        learner keeps its own anchor and outer state): the timing piece applied to ``mean`` as
        a sync applies the exchange's (eager: the last round's mean, with this replica's share
        of this round's in place of its share of that one), the outer step, and every replica
        restarted from its new anchor (as :meth:`restart`). Plain DiLoCo: one fragment."""
        leaves = jax.tree.leaves(state.params)
        anchor = jax.tree.leaves(state.anchor)
        mean = [m.astype(a.dtype) for m, a in zip(jax.tree.leaves(mean), anchor, strict=True)]
        delta = [a - p for a, p in zip(anchor, leaves, strict=True)]
        w = jnp.where(jnp.isfinite(optax.tree.norm(delta)), 1.0, 0.0)
        total_w = exchange.replica_sum(w, self.axis_name) * learners
        timing_state = state.timing_state
        if hasattr(timing_state, "pending"):  # the mean arrives now, not a round later
            timing_state = timing_state._replace(pending=mean)
        applied, timing_state = self.timing.apply(mean, delta, w, timing_state, total_w=total_w)
        anyone = total_w > 0  # else no outer step, as at a sync where nobody's was finite
        new_anchor, outer = self.outer_step(applied, anchor, state.outer_state[0], outer_scale,
                                            anyone)  # fmt: skip
        treedef = jax.tree.structure(state.anchor)
        timing_state = _where(anyone, timing_state, state.timing_state)
        state = state._replace(anchor=jax.tree.unflatten(treedef, new_anchor),
                               outer_state=(outer,), timing_state=timing_state)  # fmt: skip
        return self.restart(state, state.anchor)

    def outer_step(self, mean: list, anchor: list, outer_state: Any, outer_scale=1.0,
                   anyone=True) -> tuple[list, Any]:  # fmt: skip
        """The outer step of one fragment: ``anchor`` (a list of leaves) moved by the outer
        optimizer fed the replicas' ``mean`` pseudo-gradient, the update times
        ``outer_scale``; returns ``(anchor, outer_state)``, both unchanged where ``anyone`` is
        False (nobody contributed). Every sync takes it, and so does the syncer of independent
        learners (:mod:`diloco_jax.learners.syncer`), on the mean of their pseudo-gradients."""
        updates, new_state = self.outer.update(mean, outer_state, anchor)
        updates = [(u * outer_scale).astype(u.dtype) for u in updates]
        new_anchor = _where(anyone, optax.apply_updates(anchor, updates), anchor)
        return new_anchor, _where(anyone, new_state, outer_state)

    def _land(self, f: int, rnd: _Round, *, groups, take_anchor, treedef) -> _Round:
        """Fragment ``f``'s merged value lands: ``params_f = anchor_f`` (or, with ``mix``,
        ``mix * params_f + (1 - mix) * anchor_f``; ``take_anchor=False``: the replica keeps its
        own). A replica whose last pseudo-gradient was not finite restarts every leaf from the
        anchor with a fresh inner state."""
        members, bad = set(groups[f]), ~rnd.healthy
        restart = jnp.logical_or(take_anchor, bad)
        params = []
        for i, (p, a) in enumerate(zip(rnd.params, rnd.anchor, strict=True)):
            if i not in members:
                params.append(jnp.where(bad, a, p))
                continue
            target = a
            if self.mix > 0:
                target = jnp.where(bad, a, (self.mix * p + (1 - self.mix) * a).astype(p.dtype))
            params.append(jnp.where(restart, target, p))
        reset = restart if self.reset_inner_state else bad
        fresh = self.inner.init(jax.tree.unflatten(treedef, rnd.anchor))
        base = _where(restart, rnd.anchor, rnd.base) if self.late_merge else rnd.base
        return rnd._replace(params=params, inner_state=_where(reset, fresh, rnd.inner_state),
                            healthy=jnp.ones([], bool), base=base)  # fmt: skip

    def update(self, state: DilocoState, grads, *, active=True, weight=1.0, take_anchor=True,
               outer_scale=1.0, sync: bool = True):  # fmt: skip
        """One inner step of one replica, then the sync and landing the plan schedules.

        Written for one replica: run it under a named axis spanning the replicas
        (``jax.vmap(..., axis_name=...)`` or ``jax.shard_map``) with the algorithm's
        ``axis_name``. A replica whose pseudo-gradient holds NaN or Inf gets weight 0 and
        restarts from the anchor with a fresh inner state. If every weight is 0 the outer step
        is discarded (anchor and outer state stay) and replicas restart from the anchor.

        Args:
          state: this replica's slice of the stacked :class:`~diloco_jax.DilocoState`.
          grads: the gradients of this replica's loss, with the parameters' structure.
          active: False skips this replica's inner step (a straggler idling).
          weight: this replica's weight in the mean at a sync (0 leaves it out: dropped).
          take_anchor: False keeps the replica on its own parameters instead of restarting
            from the new anchor.
          outer_scale: multiplies the outer step (float32, the same for every replica): the
            outer learning rate changed while the run goes on, with nothing recompiled.
          sync: False takes the inner step alone, whatever the plan says (the chunked
            simulator runs the sync separately, over every replica).

        Returns:
          The pair ``(state, metrics)`` of the new state and the
          :class:`~diloco_jax.SyncStats` fields as a dict (zeros on steps that start no
          sync).
        """
        updates, inner_state = self.inner.update(grads, state.inner_state, state.params,
                                                 active=active)  # fmt: skip
        params = optax.apply_updates(state.params, updates)
        step = state.step + 1
        if not sync:
            local = state._replace(step=step, params=params, inner_state=inner_state)
            return local, zero_stats()._asdict()
        if self.moment_sync.active:  # DES-LOC: before the sync, which may reset a bad replica
            inner_state = moments.apply(self.moment_sync, step, inner_state, weight,
                                        self.axis_name)  # fmt: skip
        leaves, treedef = jax.tree.flatten(params)
        groups = self._groups(params)
        rnd = _Round(leaves, inner_state, jax.tree.leaves(state.anchor), state.outer_state,
                     state.exchange_state, state.timing_state, state.healthy, zero_stats(),
                     jax.tree.leaves(state.base))  # fmt: skip
        start = functools.partial(self._start, groups=groups, weight=weight,
                                  outer_scale=outer_scale)  # fmt: skip
        land = functools.partial(self._land, groups=groups, take_anchor=take_anchor,
                                 treedef=treedef)  # fmt: skip
        count = self.plan.fragments
        on, which = self.plan.starting(step)
        if self.plan.overlap == 0:  # the merged fragment lands in the step its sync starts
            both = [lambda r, f=f: land(f, start(f, r)) for f in range(count)]
            rnd = _maybe(on, which, both, rnd)
        else:
            rnd = _maybe(on, which, [functools.partial(start, f) for f in range(count)], rnd)
            on, which = self.plan.landing(step)
            rnd = _maybe(on, which, [functools.partial(land, f) for f in range(count)], rnd)
        new_state = DilocoState(step, jax.tree.unflatten(treedef, rnd.params), rnd.inner_state,
                                jax.tree.unflatten(treedef, rnd.anchor), rnd.outer_state,
                                rnd.exchange_state, rnd.timing_state, rnd.healthy,
                                jax.tree.unflatten(treedef, rnd.base) if self.late_merge
                                else ())  # fmt: skip
        return new_state, rnd.stats._asdict()
