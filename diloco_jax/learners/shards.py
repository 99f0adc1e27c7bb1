"""Which syncer shard holds which leaf of the anchor (issue 62, ``syncer.shards`` S): each leaf
whole, in one shard, the shards balanced by bytes.

The assignment depends only on the model's description (each leaf's name, shape and dtype, as
:func:`diloco_jax.learners.wire.describe` gives it), never on the order the leaves come in, so
every learner and every shard computes the same one from its own copy of the model. It is the
longest-processing-time rule: leaves by size, largest first (ties by name), each to the shard
that holds the fewest bytes so far (ties: the lowest index). The busiest shard then holds at
most the mean share plus the largest leaf, and at most 4/3 of the best split's busiest.

Leaves stay whole: what a push without a codec carries is each leaf under its own name, and
the outer step reads a leaf alone (every outer optimizer built here works leaf by leaf), so a
shard of whole leaves merges and steps exactly what one syncer does for them. The price is
balance where one leaf outweighs a shard's share (an embedding table of a large vocabulary at
many shards): :func:`busiest` says how much.

With a codec this is not enough. A push's leaves of at least ``codec.min_size`` values travel
as one flat vector, encoded block by block (:func:`diloco_jax.learners.payload.encode`, the
core's exchange), and a block may hold the end of one leaf and the start of the next. A shard's
part must then be a range of whole blocks of that vector, not a set of leaves, for its bits to
equal one syncer's (a block's scale is its own); top-k codecs choose over the whole vector and
cannot be cut at all. That plan is issue 62's next step.
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
