"""Streaming DiLoCo's fragments (Douillard et al., 2025, arXiv 2501.18512): which parameter
leaf belongs to which of ``F`` fragments. When each fragment syncs and lands is the sync plan's
business (:class:`diloco_jax.algorithm.plan.SyncPlan`).

Assignment (:func:`strided`): the layers of a stack (a path holding ``blocks`` then an integer
index) are strided, layer ``l`` in fragment ``l mod F``; every other leaf (embeddings, final norm,
head) joins the fragment that is smallest so far, largest leaf first, so fragments stay balanced.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _layer_index(path) -> int | None:
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path]
    for name, nxt in zip(keys, keys[1:], strict=False):
        if name in ("blocks", "layers") and isinstance(nxt, int | np.integer):
            return int(nxt)
    return None


def strided(params: Any, fragments: int) -> list[int]:
    """The fragment of each leaf of ``params`` (in ``jax.tree.leaves`` order)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    out: list[int | None] = [None] * len(leaves)
    sizes = np.zeros(fragments, np.int64)
    for i, (path, leaf) in enumerate(leaves):
        layer = _layer_index(path)
        if layer is not None:
            out[i] = layer % fragments
            sizes[out[i]] += leaf.size
    rest = [i for i in range(len(leaves)) if out[i] is None]
    for i in sorted(rest, key=lambda i: -leaves[i][1].size):
        out[i] = int(np.argmin(sizes))
        sizes[out[i]] += leaves[i][1].size
    return [int(i) for i in out if i is not None]  # every leaf has its fragment by now


def groups(assignment: list[int], fragments: int) -> list[list[int]]:
    """Leaf indices of each fragment; raises ValueError if one is empty."""
    found = [[i for i, f in enumerate(assignment) if f == g] for g in range(fragments)]
    empty = [g for g, idx in enumerate(found) if not idx]
    if empty:
        raise ValueError(f"streaming fragments {empty} of {fragments} hold no parameters")
    return found
