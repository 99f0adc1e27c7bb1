"""Building DiLoCo: :func:`diloco` picks the pieces its arguments name (the exchange, the sync
plan, the outer timing) after checking them together, and makes the inner optimizer
skippable (:func:`maskable`); :func:`init_replicas` and :func:`vmap_axes` turn any
algorithm's declared state into the replica-stacked one and its ``vmap`` axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import compress, dct, exchange, fragments, gossip, moments, robust
from diloco_jax.algorithm import state as state_lib
from diloco_jax.algorithm.core import Diloco
from diloco_jax.algorithm.exchange import AxisName
from diloco_jax.algorithm.plan import SyncPlan
from diloco_jax.algorithm.timing import make_timing
from diloco_jax.algorithm.variants import Streaming, check_options


def maskable(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` that takes an extra ``active`` argument: when False the step is skipped (zero
    updates, state unchanged). Used for stragglers' idle steps (Dynamic Local Updates)."""
    inner = optax.with_extra_args_support(inner)

    def where(cond, a, b):
        return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)

    def update_fn(updates, state, params=None, *, active=True, **extra):
        new_updates, new_state = inner.update(updates, state, params, **extra)
        if active is True:
            return new_updates, new_state
        zeros = jax.tree.map(jnp.zeros_like, new_updates)
        return where(active, new_updates, zeros), where(active, new_state, state)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def _make_exchange(axis_name, codec, dct_config, gossip_config, merge, attack):
    if not merge.plain or attack.active:
        return robust.exchange(axis_name, merge, attack)
    if gossip_config is not None:
        return gossip.gossip(axis_name, gossip_config)
    if dct_config is not None:
        return exchange.dct_momentum(axis_name, dct_config)
    if codec is not None:
        return exchange.encoded(axis_name, codec)
    return exchange.plain(axis_name)


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
    moment_sync: moments.MomentSync | None = None,
    gossip_config: gossip.Gossip | None = None,
    late_merge: bool = False,
    merge: robust.Merge | None = None,
    attack: robust.Attack | None = None,
) -> Diloco:
    """DiLoCo: ``sync_every`` local steps of ``inner``, then one ``outer`` step on the anchor.

    Every ``sync_every`` inner steps the replicas average their pseudo-gradients (anchor minus
    parameters) and ``outer`` moves the shared anchor, from which every replica restarts. The
    other arguments choose variants: how the mean travels, when fragments sync, when the outer
    step applies.

    Args:
      inner: the per-replica optimizer (the paper: AdamW).
      outer: the optimizer of the anchor, fed the replica-mean pseudo-gradient (the paper:
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
      sync_every: inner steps between syncs (the paper's H; of each fragment when streaming).
      axis_name: the named axis (or axes, reduced in order) spanning the replicas.
      reset_inner_state: re-initialise the inner state from the new anchor at every sync. The
        paper keeps it; a reset also restarts any step count inside ``inner`` (its schedule).
      diagnostics: also compute the mean pairwise cosine of pseudo-gradients at each sync (one
        more all-reduce of parameter size).
      codec: how pseudo-gradients travel (a :class:`~diloco_jax.Codec`); None or ``"none"``:
        float32. With ``codec.error_feedback`` each replica keeps what its encoding lost and
        adds it to its next pseudo-gradient.
      dct_config: exchange DCT momentum instead (a :class:`~diloco_jax.DctConfig`: DeMo's
        largest DCT components, or SparseLoCo's top-k).
      streaming: :class:`~diloco_jax.Streaming` fragments, overlap and mix (None: plain
        DiLoCo).
      outer_mode: when the outer step applies: ``"sync"`` (the paper: this sync's mean),
        ``"delayed"`` (the previous sync's mean, whose all-reduce ran during the round) or
        ``"eager"`` (the previous mean with this replica's fresh share in place of its stale
        one; every replica keeps its own anchor).
      fragment_of: ``(params, fragments) -> the fragment of each leaf`` (default:
        ``diloco_jax.algorithm.fragments.strided``, layer ``l`` of a stack in fragment
        ``l mod F``, the other leaves balancing the fragments' sizes).
      moment_sync: DES-LOC's periods of averaging the inner optimizer's first and second
        moments across replicas (a :class:`~diloco_jax.algorithm.MomentSync`; None: never).
      gossip_config: NoLoCo: every replica averages with one partner, keeping its own anchor
        (a :class:`~diloco_jax.algorithm.gossip.Gossip`; None: the all-replica mean).
      late_merge: replicas may miss syncs (quorum and grace, after Decoupled DiLoCo, arXiv
        2604.21428): each keeps the anchor it restarted from (``base``) and its pseudo-gradient
        is ``base - params``, so a replica left out of a sync (``weight=0``,
        ``take_anchor=False``) merges all its work since at a later one, weighted by its tokens
        (the caller's ``weight``; the simulator computes it from ``sim.quorum`` and
        ``sim.grace``).
      merge: how a sync merges the pseudo-gradients (a
        :class:`~diloco_jax.algorithm.robust.Merge`: the weighted mean, a trimmed mean, the
        median or centered clipping, with or without norm clipping; None: the weighted mean,
        the plain exchange).
      attack: hostile replicas, for studying the merge rules (a
        :class:`~diloco_jax.algorithm.robust.Attack`; None: none): once every replica's
        pseudo-gradient is gathered, theirs are replaced as the attack says.

    Returns:
      The :class:`~diloco_jax.Diloco` algorithm; :func:`~diloco_jax.init_replicas` builds its
      state.

    Raises:
      OptionError: an option out of range or a combination that is not supported (the checks
        of :func:`~diloco_jax.check_options`).
    """
    check_options(sync_every=sync_every, streaming=streaming, outer_mode=outer_mode, codec=codec,
                  dct_config=dct_config, reset_inner_state=reset_inner_state,
                  moment_sync=moment_sync, gossip_config=gossip_config,
                  late_merge=late_merge, merge=merge, attack=attack)  # fmt: skip
    merge = robust.Merge() if merge is None else robust.Merge(*merge)
    attack = robust.Attack() if attack is None else robust.Attack(*attack)
    codec = None if codec is None or codec.name == "none" else codec
    streaming = Streaming() if streaming is None else Streaming(*streaming)
    plan = SyncPlan(sync_every, streaming.fragments, streaming.overlap)
    return Diloco(
        inner=maskable(inner), outer=outer, plan=plan,
        exchange=_make_exchange(axis_name, codec, dct_config, gossip_config, merge, attack),
        timing=make_timing(outer_mode, axis_name), axis_name=axis_name, mix=streaming.mix,
        reset_inner_state=reset_inner_state, diagnostics=diagnostics, fragment_of=fragment_of,
        moment_sync=moments.MomentSync(*(moment_sync or ())), late_merge=late_merge,
        merge=merge,
    )  # fmt: skip


def init_replicas(algorithm, params, replicas: int):
    """The replica-stacked initial state of ``algorithm``: every replica starts from
    ``params``.

    Args:
      algorithm: a :class:`~diloco_jax.Diloco`, or a baseline (:func:`~diloco_jax.single`,
        :func:`~diloco_jax.data_parallel`).
      params: the initial parameters, a pytree of float arrays.
      replicas: the number of replicas, ``R``.

    Returns:
      The state with its per-replica fields stacked on a leading ``[R]`` axis and its shared
      fields stored once (as the algorithm's ``kinds`` declare). It owns fresh buffers, so
      donating it never invalidates ``params``.
    """
    return state_lib.stack(algorithm.init(params), algorithm.kinds, replicas)


def vmap_axes(algorithm):
    """The ``in_axes`` / ``out_axes`` of ``algorithm``'s state for :func:`jax.vmap`.

    Args:
      algorithm: a :class:`~diloco_jax.Diloco` or a baseline.

    Returns:
      A pytree prefix of the state, 0 for per-replica fields and None for shared ones.
    """
    return state_lib.vmap_axes(algorithm.kinds)
