"""Which syncer shard holds which leaf of the anchor (issue 62, ``syncer.shards`` S): each leaf
whole, in one shard, the shards balanced by bytes.

The assignment depends only on the model's description (each leaf's name, shape and dtype, as
:func:`diloco_jax.learners.wire.describe` gives it), never on the order the leaves come in, so
every learner and every shard computes the same one from its own copy of the model. It is the
longest-processing-time rule: leaves by size, largest first (ties by name), each to the shard
that holds the fewest bytes so far (ties: the lowest index). The busiest shard then holds at
most the mean share plus the largest leaf, and at most 4/3 of the best split's busiest.

Leaves stay whole. A leaf is the unit of everything a push and an answer carry: its name, the
codec's blocks and its ``min_size`` rule, a streaming fragment, the NaN check. Cutting one in
two would change what a blockwise codec encodes at the cut, and with it the bits a shard
merges, which must equal one syncer's. The price is balance where one leaf outweighs a shard's
share (an embedding table of a large vocabulary at many shards): :func:`busiest` says how much.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def leaf_bytes(shape: Sequence[int], dtype: str) -> int:
    """The bytes of a leaf of ``shape`` and ``dtype`` (a numpy dtype's name)."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def assign(describe: Sequence[Sequence], shards: int) -> list[int]:
    """The shard of each leaf of ``describe`` (``[[name, shape, dtype], ...]``), in its order:
    balanced by bytes, the same for any order of the same leaves. Raises ValueError for
    ``shards`` < 1 or two leaves of one name (the name is what orders ties)."""
    if shards < 1:
        raise ValueError(f"syncer.shards must be at least 1, not {shards}")
    names = [str(name) for name, _, _ in describe]
    if len(set(names)) != len(names):
        raise ValueError("two leaves of one name: a shard assignment needs distinct names")
    sizes = {str(name): leaf_bytes(shape, dtype) for name, shape, dtype in describe}
    load = [0] * shards
    owner: dict[str, int] = {}
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        shard = min(range(shards), key=lambda s: (load[s], s))
        owner[name] = shard
        load[shard] += sizes[name]
    return [owner[name] for name in names]


def loads(describe: Sequence[Sequence], assignment: Sequence[int], shards: int) -> list[int]:
    """The bytes each of ``shards`` holds under ``assignment``."""
    held = [0] * shards
    for (_, shape, dtype), shard in zip(describe, assignment, strict=True):
        held[shard] += leaf_bytes(shape, dtype)
    return held


def busiest(describe: Sequence[Sequence], shards: int) -> float:
    """The busiest shard's bytes over the mean share (1.0: perfectly balanced)."""
    held = loads(describe, assign(describe, shards), shards)
    return max(held) * shards / max(sum(held), 1)
