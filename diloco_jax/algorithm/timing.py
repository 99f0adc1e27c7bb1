"""When the outer step applies: small pieces with their own state, chosen by name.

* ``sync`` (the paper): the anchor moves by this sync's mean ``Delta^(t)``.
* ``delayed``: the anchor moves by the previous sync's mean, whose all-reduce ran during the
  round in between (Kale et al., 2025, arXiv 2502.12996). State: ``pending`` (shared).
* ``eager``: replica ``r`` applies ``Delta^(t-1) + s_r^(t) - s_r^(t-1)``, its fresh share
  ``s_r = w_r delta_r / sum_q w_q`` of the mean in place of its stale one, so each replica keeps
  its own anchor and outer state (their kind is per replica). State: ``pending`` (shared),
  ``last_share`` (per replica).

``apply(mean, delta, w, state, total_w=None) -> (applied, state)`` is written for one replica
under the replica axis; leaves are lists (one fragment, or all parameters), in the parameters'
dtype. ``total_w``: the weight the mean is over (None: the replica axis's, summed); a learner
whose mean is merged with other learners' by a syncer passes every learner's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from diloco_jax.algorithm.exchange import AxisName, replica_sum
from diloco_jax.algorithm.options import OptionError
from diloco_jax.algorithm.state import PER_REPLICA, SHARED, declare

OUTER_MODES = ("sync", "delayed", "eager")


class DelayedState(NamedTuple):
    pending: list  # the last sync's mean, applied at the next one (parameters' dtype)


class EagerState(NamedTuple):
    pending: list  # the last sync's mean (parameters' dtype)
    last_share: list  # this replica's share of ``pending`` (parameters' dtype)


class Timing(NamedTuple):
    """An outer timing piece. ``kinds``: its state's kinds; ``anchor_kind``: the kind of the
    anchor and outer state it needs."""

    name: str
    init: Callable[[list], Any]
    apply: Callable[..., tuple[list, Any]]
    kinds: Any
    anchor_kind: str


def _zeros(leaves: list) -> list:
    return [jnp.zeros_like(x) for x in leaves]


def _share(delta: list, w, axis_name: AxisName, total_w=None) -> list:
    total_w = replica_sum(w, axis_name) if total_w is None else total_w
    return [(jnp.where(w > 0, w * d, 0.0) / jnp.maximum(total_w, 1e-30)).astype(d.dtype)
            for d in delta]  # fmt: skip


def make_timing(mode: str, axis_name: AxisName) -> Timing:
    """The piece for ``mode`` (one of :data:`OUTER_MODES`); raises ValueError otherwise."""
    if mode == "sync":
        return Timing("sync", lambda leaves: (), lambda mean, delta, w, st, total_w=None: (
            mean, st), (), SHARED)  # fmt: skip
    if mode == "delayed":
        return Timing(
            "delayed",
            lambda leaves: DelayedState(_zeros(leaves)),
            lambda mean, delta, w, st, total_w=None: (st.pending, DelayedState(mean)),
            declare(DelayedState, SHARED),
            SHARED,
        )
    if mode == "eager":

        def apply(mean, delta, w, st, total_w=None):
            share = _share(delta, w, axis_name, total_w)
            applied = [m + s - old for m, s, old in zip(st.pending, share, st.last_share,
                                                        strict=True)]  # fmt: skip
            return applied, EagerState(mean, share)

        init = lambda leaves: EagerState(_zeros(leaves), _zeros(leaves))  # noqa: E731
        return Timing("eager", init, apply, declare(EagerState, SHARED, PER_REPLICA), PER_REPLICA)
    raise OptionError("outer_mode", mode, f"must be one of {OUTER_MODES}")
