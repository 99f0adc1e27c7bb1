"""DES-LOC's optimizer-state averaging (Iacob et al., 2025, arXiv 2505.22549): the replicas
average their inner optimizer's first moments every ``first_every`` inner steps and its second
moments every ``second_every``, each on its own period, besides DiLoCo's parameter sync.

The moments are the leaves of the inner optimizer's state that sit under a field named ``mu``
(first) or ``nu`` (second), as optax's Adam, AdamW and Muon name them; an inner optimizer without
such fields has nothing to average. The average is weighted as the sync's (a dropped replica
weighs 0) and leaves out a replica whose moments are not finite; every replica takes the mean
(when nobody contributes, each keeps its own). Periods are multiples of ``sync_every``, so
moments are averaged only at sync steps, before the sync (its restart of a non-finite replica
then starts from a fresh state).

Dtypes: each moment keeps its own dtype; sums run in ``promote(float32, dtype)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diloco_jax.algorithm.exchange import AxisName, replica_mean
from diloco_jax.algorithm.options import require

FIELDS = {"first": "mu", "second": "nu"}


class MomentSync(NamedTuple):
    """DES-LOC's moment averages, the ``moment_sync`` of :func:`~diloco_jax.diloco`: inner
    steps between averages of the inner optimizer's first and second moments across replicas.

    Args:
      first_every: inner steps between averages of the first moments (0: never; else a
        multiple of ``sync_every``).
      second_every: inner steps between averages of the second moments (0: never; else a
        multiple of ``sync_every``).
    """

    first_every: int = 0
    second_every: int = 0

    @property
    def active(self) -> bool:
        return self.first_every > 0 or self.second_every > 0


def validate(ms: MomentSync, sync_every: int, reset_inner_state: bool) -> None:
    """Raises :class:`~diloco_jax.algorithm.options.OptionError` for periods that cannot run."""
    for name, every in (("first_every", ms.first_every), ("second_every", ms.second_every)):
        option = f"moment_sync.{name}"
        require(every >= 0, option, every, "must be an integer >= 0 (0: never)")
        require(every % sync_every == 0, option, every,
                f"must be a multiple of {{sync_every}} = {sync_every} (0: never)")  # fmt: skip
    require(not (ms.active and reset_inner_state), "moment_sync", tuple(ms),
            "averages the inner state that {reset_inner_state} discards: choose one")  # fmt: skip


def _named(path, field: str) -> bool:
    return any(getattr(k, "name", None) == field for k in path)


def moment_leaves(inner_state: Any, which: str) -> list[int]:
    """Indices (in ``jax.tree.leaves`` order) of the ``which`` (first, second) moment leaves."""
    leaves = jax.tree_util.tree_leaves_with_path(inner_state)
    return [i for i, (path, _) in enumerate(leaves) if _named(path, FIELDS[which])]


def _average(leaves: list, idx: list[int], weight, axis_name: AxisName) -> list:
    """``leaves[i]`` for ``i`` in ``idx`` replaced by their weighted replica mean."""
    own = [leaves[i] for i in idx]
    finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in own]))
    w = jnp.where(finite, jnp.asarray(weight, jnp.float32), 0.0)
    total_w = replica_mean(w, axis_name)
    sums = replica_mean([jnp.where(w > 0, w * x.astype(jnp.promote_types(x.dtype, jnp.float32)),
                                   0.0) for x in own], axis_name)  # fmt: skip
    inverse = 1.0 / jnp.maximum(total_w, 1e-30)
    out = list(leaves)
    for i, x, s in zip(idx, own, sums, strict=True):
        out[i] = jnp.where(total_w > 0, (s * inverse).astype(x.dtype), x)
    return out


def apply(ms: MomentSync, step, inner_state: Any, weight, axis_name: AxisName) -> Any:
    """``inner_state`` after inner step ``step`` (a shared scalar), its moments averaged where
    their periods say. Each period is its own ``lax.cond`` on the shared step: a branch under
    ``vmap``, so nothing is reduced on other steps."""
    leaves, treedef = jax.tree.flatten(inner_state)
    for which, every in (("first", ms.first_every), ("second", ms.second_every)):
        idx = moment_leaves(inner_state, which)
        if every and idx:
            leaves = lax.cond(step % every == 0,
                              lambda ls, idx=idx: _average(ls, idx, weight, axis_name),
                              lambda ls: list(ls), leaves)  # fmt: skip
    return jax.tree.unflatten(treedef, leaves)


def payload_leaves(inner_state: Any, which: str) -> list:
    """The leaves (or their shapes) one average of ``which`` moments sends: for byte counts."""
    leaves = jax.tree.leaves(inner_state)
    return [leaves[i] for i in moment_leaves(inner_state, which)]
