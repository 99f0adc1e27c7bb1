"""Streaming DiLoCo's fragments and their schedule (Douillard et al., 2025, arXiv 2501.18512).

The parameters are split into ``F`` fragments. Fragment ``f`` starts its sync every
``sync_every`` steps at offset ``f * sync_every / F``: one fragment syncs every
``period = sync_every / F`` steps, fragment ``(step / period) mod F`` at step ``step``, so peak
bytes per sync fall by about ``F``. Its merged value lands ``overlap`` (tau) steps later, while
training goes on; ``overlap = 0`` lands it at once. ``F = 1`` is plain DiLoCo.

Assignment (:func:`strided`): the layers of a stack (a path holding ``blocks`` then an integer
index) are strided, layer ``l`` in fragment ``l mod F``; every other leaf (embeddings, final norm,
head) joins the fragment that is smallest so far, largest leaf first, so fragments stay balanced.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
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
    return out


def groups(assignment: list[int], fragments: int) -> list[list[int]]:
    """Leaf indices of each fragment; raises ValueError if one is empty."""
    found = [[i for i, f in enumerate(assignment) if f == g] for g in range(fragments)]
    empty = [g for g, idx in enumerate(found) if not idx]
    if empty:
        raise ValueError(f"streaming fragments {empty} of {fragments} hold no parameters")
    return found


def period(sync_every: int, fragments: int) -> int:
    if sync_every % fragments:
        raise ValueError(f"sync_every {sync_every} must be a multiple of fragments {fragments}")
    return sync_every // fragments


def starting(step: jax.Array, sync_every: int, fragments: int) -> tuple[jax.Array, jax.Array]:
    """``(whether a sync starts after inner step `step`, which fragment)``; ``step`` counts
    from 1 and is a shared scalar."""
    every = period(sync_every, fragments)
    return step % every == 0, (step // every) % fragments


def landing(
    step: jax.Array, sync_every: int, fragments: int, overlap: int
) -> tuple[jax.Array, jax.Array]:
    """``(whether a fragment lands after inner step `step`, which)``: the one whose sync started
    ``overlap`` steps earlier."""
    started, fragment = starting(step - overlap, sync_every, fragments)
    return jnp.logical_and(started, step > overlap), fragment


def sync_steps(total_steps: int, sync_every: int, fragments: int) -> list[tuple[int, int]]:
    """Host side: ``(step, fragment)`` of every sync start in ``total_steps`` inner steps."""
    every = period(sync_every, fragments)
    return [(s, (s // every) % fragments) for s in range(every, total_steps + 1, every)]
