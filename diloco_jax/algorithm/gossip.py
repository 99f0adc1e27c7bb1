"""NoLoCo's exchange (Kolehmainen et al., 2025, arXiv 2506.10911): no all-reduce. At each sync
every replica averages with one partner, and each keeps its own anchor ``phi_r`` and outer
state. For replica ``r`` and its partner ``p`` (weights ``w``; a left-out partner counts 0)::

    mean_r   = (w_r delta_r + w_p delta_p) / (w_r + w_p)     # the pair's pseudo-gradient
    applied  = mean_r + pull (phi_r - (phi_r + phi_p) / 2)   # and the pull to the pair's anchor

and the outer optimizer moves ``phi_r`` by ``applied``. With heavy-ball SGD (lr ``beta``,
momentum ``alpha``, no Nesterov) this is the authors' update ``delta_r <- alpha delta_r - beta
mean_r - gamma (phi_r - mean phi)``, ``phi_r += delta_r``, with ``gamma = pull * beta`` (their
code uses ``gamma = beta``: ``pull = 1``; the paper's runs: ``beta = 0.7``, ``alpha = 0.5``,
``sync_every = 50``). Each replica sends its partner its pseudo-gradient and its anchor.

Partners come from seeded permutations: pairing ``k`` takes ``perm = permutation(R)`` of the
generator ``(seed, k)`` and pairs ``perm[i]`` with ``perm[i + R/2]``. A ``lax.ppermute`` needs
its pairs at compile time, so ``pairings`` of them are compiled, one branch each, and sync ``n``
uses pairing ``n mod pairings`` (the exchange's state counts the syncs).

Layouts: the simulator (one ``vmap`` axis) and a mesh with one replica per device; a mesh
device holding several replicas is refused (the pairs would cross both axes).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from diloco_jax.algorithm import compress
from diloco_jax.algorithm.exchange import AxisName, Exchange
from diloco_jax.algorithm.options import require
from diloco_jax.algorithm.state import PER_REPLICA


class Gossip(NamedTuple):
    """NoLoCo's gossip, the ``gossip_config`` of :func:`~diloco_jax.diloco`: at every sync
    each replica averages with one partner, keeping its own anchor.

    Args:
      replicas: the number of replicas (even, >= 2: they pair up).
      seed: the seed of the random pairings.
      pull: the weight of the pull toward the pair's mean anchor (gamma / beta), in
        ``[0, 2]``.
      pairings: how many pairings are compiled; sync ``n`` uses pairing ``n mod pairings``.
    """

    replicas: int
    seed: int = 0
    pull: float = 1.0
    pairings: int = 8


def validate(g: Gossip) -> None:
    require(g.replicas >= 2 and g.replicas % 2 == 0, "gossip.replicas", g.replicas,
            "must be even and >= 2 (replicas pair up)")  # fmt: skip
    require(0 <= g.pull <= 2, "gossip.pull", g.pull, "must be in [0, 2]")
    require(g.pairings >= 1, "gossip.pairings", g.pairings, "must be an integer >= 1")


def partners(g: Gossip) -> np.ndarray:
    """int ``[pairings, R]``: each replica's partner in each pairing."""
    out = np.empty((g.pairings, g.replicas), np.int64)
    half = g.replicas // 2
    for k in range(g.pairings):
        perm = np.random.default_rng([g.seed, k]).permutation(g.replicas)
        out[k, perm[:half]], out[k, perm[half:]] = perm[half:], perm[:half]
    return out


def _axis(axis_name: AxisName) -> str:
    """The one axis the pairs run over: the device axis of a mesh whose devices hold one
    replica each (its local axis has size 1), or the simulator's axis."""
    *local, last = compress.names(axis_name)
    for name in local:
        if lax.axis_size(name) != 1:
            raise ValueError("NoLoCo pairs replicas over one axis: give each mesh device one "
                             "replica (parallel.replica_devices = parallel.replicas)")  # fmt: skip
    return last


def gossip(axis_name: AxisName, g: Gossip) -> Exchange:
    """The pairwise exchange (state: int32 syncs so far, per replica)."""
    table = partners(g)

    def swap(k: int, tree):
        # replica r sends to its partner; pairs are symmetric, so r receives its partner's
        return lax.ppermute(tree, _axis(axis_name), [(r, int(p)) for r, p in enumerate(table[k])])

    def mean(delta, w, finite, count, anchor=None):
        del finite  # w is 0 for a non-finite replica already
        mine = ([jnp.where(w > 0, w * d, 0.0) for d in delta], jnp.maximum(w, 0.0), anchor)
        branches = [functools.partial(swap, k) for k in range(g.pairings)]
        theirs = lax.switch(count % g.pairings, branches, mine)
        total_w = mine[1] + theirs[1]
        inverse = 1.0 / jnp.maximum(total_w, 1e-30)
        pair_mean = [(a + b) * inverse for a, b in zip(mine[0], theirs[0], strict=True)]
        present = theirs[1] > 0  # an absent partner's anchor does not pull
        pulled = [m + g.pull * jnp.where(present, (phi - other) / 2, 0.0)
                  for m, phi, other in zip(pair_mean, anchor, theirs[2], strict=True)]  # fmt: skip
        return pulled, count + 1, total_w

    return Exchange(lambda leaves: jnp.zeros([], jnp.int32), mean, PER_REPLICA)


def pair_payload(tree) -> int:
    """Bytes one replica sends its partner at a sync: its weighted pseudo-gradient (float32, or
    wider) and its anchor (the parameters' dtype); the weight itself is not counted."""
    leaves = jax.tree.leaves(tree)
    wide = sum(np.dtype(np.promote_types(x.dtype, np.float32)).itemsize * np.size(x)
               for x in leaves)  # fmt: skip
    return int(wide + sum(np.dtype(x.dtype).itemsize * np.size(x) for x in leaves))
