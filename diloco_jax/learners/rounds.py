"""What a syncer's round is made of: its members, their pushes, the weighted merge, and the
anchor's hash in the tape. Pure data and arithmetic; :mod:`diloco_jax.learners.syncer` holds
the rules."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


@dataclasses.dataclass
class Member:
    generation: int
    joined_round: int
    last_seen: float
    status: str = "present"  # present | dropped | left
    pushes: int = 0
    late: int = 0  # pushes merged into a later round than the one they were computed for


@dataclasses.dataclass
class Push:
    generation: int
    weight: float
    mean: list  # float32 leaves, in the anchor's order
    finite: bool
    late: int = 0  # rounds behind the one it joins


def digest(leaves: list) -> str:
    """A short hash of a list of arrays (the tape's anchor hash)."""
    h = hashlib.sha256()
    for x in leaves:
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


def merge(pushes: list[Push]) -> tuple[list, float]:
    """The pushes' mean weighted by their examples: ``sum_l (w_l / W) m_l`` in float32, in
    learner order (each weight divided first, so equal weights scale exactly and one
    learner's mean passes unchanged); leaves out pushes that are not finite."""
    finite = [p for p in pushes if p.finite and p.weight > 0]
    total_w = sum(p.weight for p in finite)
    if not finite:
        return [np.zeros_like(x) for x in pushes[0].mean], 0.0
    total: list | None = None
    for p in finite:
        share = np.float32(p.weight / total_w)
        part = [share * x for x in p.mean]
        total = part if total is None else [t + x for t, x in zip(total, part, strict=True)]
    return total or [], total_w
