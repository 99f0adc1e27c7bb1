"""What a syncer's round is made of: its members, their pushes, the weighted merge, and the
anchor's hash in the tape. Pure data and arithmetic; :mod:`diloco_jax.learners.syncer` holds
the rules."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

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
    mean: Any  # float32 leaves in the anchor's order: a list, or a file (:class:`.intake.Spilled`)
    finite: bool
    late: int = 0  # rounds behind the one it joins
    id: str = ""  # the learner's id for it: a push is merged once, whatever the retries
    base: int = 0  # the round whose anchor it was computed against

    def leaves(self) -> list:
        return self.mean if isinstance(self.mean, list) else self.mean.leaves()


def digest(leaves: list) -> str:
    """A short hash of a list of arrays (the tape's anchor hash)."""
    h = hashlib.sha256()
    for x in leaves:
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


def merge(pushes: list[Push]) -> tuple[list, float]:
    """The pushes' mean weighted by their examples: ``sum_l (w_l / W) m_l`` in float32, in
    learner order (each weight divided first, so equal weights scale exactly and one
    learner's mean passes unchanged); leaves out pushes that are not finite. One push's leaves
    are in memory at a time (a push in a file is read when its turn comes), and each is added
    leaf by leaf: memory is the model's size twice, whatever the number of pushes."""
    finite = [p for p in pushes if p.finite and p.weight > 0]
    total_w = sum(p.weight for p in finite)
    if not finite:
        return [np.zeros_like(x, np.float32) for x in pushes[0].leaves()], 0.0
    total: list = []
    for p in finite:
        share = np.float32(p.weight / total_w)
        leaves = p.leaves()
        if not total:
            total = [share * x for x in leaves]
            continue
        for t, x in zip(total, leaves, strict=True):
            t += share * x  # the same two float32 roundings as t + (share * x)
        del leaves
    return total, total_w
