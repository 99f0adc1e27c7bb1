"""Every per-replica random key, derived in one place.

``replica_key(seed, step, replica)`` is ``fold_in(fold_in(key(seed), step), replica)``: the batch
a replica draws is a pure function of ``(seed, replica, step)``, so a resumed or re-sharded run
sees the same data. Other uses fold in a stream tag so their keys never coincide with the batch
key. No device, process or shard index is ever folded in: a key is the same on every layout.
"""

from __future__ import annotations

import jax

DROPOUT = 0x0D0  # dropout masks


def replica_key(seed, step, replica, *streams) -> jax.Array:
    """``fold_in(fold_in(key(seed), step), replica)``, then each of ``streams`` folded in."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), replica)
    for stream in streams:
        key = jax.random.fold_in(key, stream)
    return key
