"""What a sync reports: how far replicas drifted and how much their pseudo-gradients agree."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm.exchange import replica_sum


class SyncStats(NamedTuple):
    """Diagnostics of a sync, returned as metrics by the step that starts it (zeros on other
    steps). Every field is a float32 scalar except ``finite`` (bool).

    Attributes:
      drift: per-replica. ``|anchor - params_r|`` over the synced fragment: how far the replica
        moved from the anchor during the round (the norm of its pseudo-gradient).
      cosine_to_mean: per-replica. Cosine between the replica's pseudo-gradient and the mean one.
      weight: per-replica. The replica's weight in the mean (0: left out).
      pairwise_cosine: shared. Mean cosine similarity over pairs of contributing replicas'
        pseudo-gradients (NaN unless ``diagnostics``; it costs one more all-reduce).
      outer_update_norm: shared (per-replica with eager updates). ``|anchor' - anchor|``.
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


def _dot(a: Any, b: Any) -> jax.Array:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return cast(jax.Array, sum(jnp.vdot(x, y) for x, y in pairs))  # a Python sum: 0 + x is x


def zero_stats() -> SyncStats:
    """The stats of a step that starts no sync."""
    zero = jnp.zeros([], jnp.float32)
    return SyncStats(zero, zero, zero, zero, zero, zero, jnp.ones([], bool))


def sync_stats(delta, mean_delta, weight, outer_norm, axis_name, diagnostics) -> SyncStats:
    """:class:`SyncStats` of one replica's pseudo-gradient ``delta`` (a list of leaves) against
    the ``mean_delta``; ``weight`` is the replica's weight in the mean. Computed in float32
    whatever the parameters' dtype."""
    delta = [d.astype(jnp.float32) for d in delta]
    mean_delta = [m.astype(jnp.float32) for m in mean_delta]
    outer_norm = jnp.asarray(outer_norm, jnp.float32)
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
