"""Replicas larger than a device: each replica's state sharded over its ``DATA`` devices.

FSDP / ZeRO-3 within a replica (``parallel.fsdp``): every leaf of the replica-stacked state
(parameters, inner optimizer state, anchor, outer state, exchange state) is split over ``DATA``
along one of its axes, so a replica's state takes ``1 / data_devices`` of each device's memory.
Nothing here gathers by hand: the mesh step runs a ``shard_map`` that is manual over ``REPLICA``
only, the ``DATA`` axis is left to XLA's SPMD partitioner, and these specs (as
``with_sharding_constraint`` inside the step and as the call's shardings) tell it where each leaf
lives; XLA then all-gathers a weight for its matmul and reduce-scatters its gradient. Norms,
codecs and the outer step see whole arrays, so every piece of the algorithm runs unchanged.

Which axis: the largest one that ``data_devices`` divides (the first of equals). A leaf with
none (a scalar, an odd-sized bias) stays whole on every device of its replica.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from diloco_jax.algorithm import state as state_lib
from diloco_jax.base.axes import DATA, REPLICA


def leaf_spec(shape: tuple[int, ...], devices: int, *, leading: tuple = ()) -> P:
    """``P(*leading, ...)`` with ``DATA`` on the largest axis of ``shape`` that ``devices``
    divides (``shape`` excludes the ``leading`` axes); no ``DATA`` if none does."""
    dims: list[str | None] = [None] * len(shape)
    fits = [i for i, n in enumerate(shape) if n % devices == 0 and n >= devices]
    if devices > 1 and fits:
        dims[max(fits, key=lambda i: (shape[i], -i))] = DATA
    return P(*leading, *dims)


def state_specs(state: Any, kinds: Any, devices: int) -> Any:
    """The global ``PartitionSpec`` of every leaf of a replica-stacked ``state`` (arrays or
    shapes): per-replica leaves ``P(REPLICA, ...)``, shared ones ``P(...)``, each with ``DATA`` on
    one axis (:func:`leaf_spec`)."""

    def one(kind, sub):
        if kind == state_lib.PER_REPLICA:
            return jax.tree.map(lambda x: leaf_spec(x.shape[1:], devices, leading=(REPLICA,)), sub)
        return jax.tree.map(lambda x: leaf_spec(x.shape, devices), sub)

    return jax.tree.map(one, kinds, state, is_leaf=lambda k: isinstance(k, str))


def local_specs(specs: Any) -> Any:
    """``specs`` as the body of a ``shard_map`` manual over ``REPLICA`` names them: the replica
    axis is its own (local replicas), only ``DATA`` is left to constrain."""
    return jax.tree.map(lambda spec: P(*(None if a == REPLICA else a for a in spec)), specs,
                        is_leaf=lambda x: isinstance(x, P))  # fmt: skip


def constrain(tree: Any, specs: Any) -> Any:
    """``tree`` laid out as ``specs`` say (``with_sharding_constraint``, leaf by leaf)."""
    return jax.tree.map(lax.with_sharding_constraint, tree, specs)


def rows(batch: Any, axis: str = DATA) -> Any:
    """A replica's batch with its rows split over ``axis`` (XLA partitions what follows)."""
    return jax.tree.map(lambda x: lax.with_sharding_constraint(x, P(axis)), batch)
