"""Which parts of a replica-stacked state are per replica and which are shared, declared once.

An algorithm's state is a NamedTuple; its *kinds* are a NamedTuple of the same type whose
fields are :data:`PER_REPLICA` or :data:`SHARED` (or, for a field that is itself a NamedTuple of
a piece, that piece's kinds). Every layout is derived from the kinds:

* :func:`vmap_axes`: ``in_axes``/``out_axes`` prefix for ``jax.vmap`` (0 or None);
* :func:`stack`: the replica-stacked initial state (per-replica fields broadcast to ``[R, ...]``);
* :func:`specs`: ``PartitionSpec`` prefix for ``shard_map`` and device placement;
* :func:`shared_part` / :func:`replace_shared`: what an elastic restart carries over and what
  the replica-consistency checks compare across devices.

A field declared nowhere cannot exist: the kinds have the state's own type, so adding a field
without declaring its kind fails at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from diloco_jax.base.axes import REPLICA

#: The kind of a state field that holds one value per replica, on a leading ``[R]`` axis
#: (``params``, ``inner_state``). :attr:`Diloco.kinds <diloco_jax.Diloco.kinds>` gives each
#: field of :class:`~diloco_jax.DilocoState` a kind; the ``vmap`` axes, ``shard_map`` specs and
#: checkpoint layout derive from it.
PER_REPLICA = "per_replica"
#: The kind of a state field stored once for all replicas: ``step``, and ``anchor`` and
#: ``outer_state`` unless the outer steps are eager.
SHARED = "shared"
T = TypeVar("T")


def declare(cls: Callable[..., T], *kinds: Any, **named: Any) -> T:
    """A state's kinds: ``cls`` (a state NamedTuple) built with a kind, or a tree of kinds, in
    each field instead of its arrays (``declare(LocalState, SHARED, PER_REPLICA, ...)``)."""
    return cls(*kinds, **named)


def _is_kind(x) -> bool:
    return isinstance(x, str)


def vmap_axes(kinds: Any) -> Any:
    """``jax.vmap`` axes prefix: 0 for per-replica fields, None for shared ones."""
    return jax.tree.map(lambda k: 0 if k == PER_REPLICA else None, kinds, is_leaf=_is_kind)


def specs(kinds: Any) -> Any:
    """``shard_map`` / placement prefix: ``P(REPLICA)`` per replica, ``P()`` shared."""
    return jax.tree.map(lambda k: P(REPLICA) if k == PER_REPLICA else P(), kinds,
                        is_leaf=_is_kind)  # fmt: skip


def stack(state: Any, kinds: Any, replicas: int) -> Any:
    """A one-replica ``state`` made replica-stacked: per-replica leaves broadcast to ``[R, ...]``
    (every replica starts equal), shared ones copied once. The result owns fresh buffers, so
    donating it never invalidates the caller's arrays."""

    def one(kind, sub):
        if kind == SHARED:
            return jax.tree.map(jnp.copy, sub)
        return jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x)[None], replicas, axis=0), sub)

    return jax.tree.map(one, kinds, state, is_leaf=_is_kind)


def _select(kinds: Any, state: Any, want: str, other: Any) -> Any:
    return jax.tree.map(lambda k, sub: sub if k == want else other, kinds, state,
                        is_leaf=_is_kind)  # fmt: skip


def shared_part(state: Any, kinds: Any) -> Any:
    """``state`` with every per-replica field replaced by ``()``: what all replicas hold in
    common (and what must be bitwise identical on every device)."""
    return _select(kinds, state, SHARED, ())


def replace_shared(state: Any, kinds: Any, shared: Any) -> Any:
    """``state`` with its shared fields taken from ``shared`` (another state of the same kinds)."""
    return jax.tree.map(lambda k, mine, theirs: theirs if k == SHARED else mine, kinds, state,
                        shared, is_leaf=_is_kind)  # fmt: skip


def replica_count(state: Any, kinds: Any) -> int | None:
    """The leading axis of the per-replica leaves of a stacked state (None if it has none)."""
    per = jax.tree.leaves(_select(kinds, state, PER_REPLICA, ()))
    return int(per[0].shape[0]) if per else None
