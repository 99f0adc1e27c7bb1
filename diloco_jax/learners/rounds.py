"""What a syncer's round is made of: its members, their pushes, the weighted merge, and the
anchor's hash in the tape. Pure data and arithmetic; :mod:`diloco_jax.learners.syncer` holds
the rules."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from diloco_jax.learners import wire


@dataclasses.dataclass
class Member:
    generation: int
    joined_round: int
    last_seen: float
    status: str = "present"  # present | dropped | left
    pushes: int = 0
    late: int = 0  # pushes merged into a later round than the one they were computed for
    refused: int = 0  # pushes refused (stale, a conflict, a weight or loss out of range, ...)
    loss: float | None = None  # the training loss its last push carried (None: none yet)
    capped: int = 0  # pushes whose weight was above its capacity, capped to it (issue 63)
    # a robust merge's view of its last merged push (issue 63: norm, distance, clipped,
    # trimmed, outlier) and whether it was an outlier in most of its last rounds
    merge: dict[str, Any] | None = None
    suspect: bool = False


@dataclasses.dataclass
class Push:
    generation: int
    weight: float
    mean: Any  # float32 leaves in the anchor's order: a list, or a file (:class:`.intake.Spilled`)
    finite: bool
    late: int = 0  # rounds behind the one it joins
    id: str = ""  # the learner's id for it: a push is merged once, whatever the retries
    base: int = 0  # the round whose anchor it was computed against
    loss: float | None = None  # the learner's mean training loss over the round (None: not said)

    def leaves(self) -> list:
        return self.mean if isinstance(self.mean, list) else self.mean.leaves()

    def leaf(self, i: int):
        return self.mean[i] if isinstance(self.mean, list) else self.mean.leaf(i)

    def count(self) -> int:
        return len(self.mean) if isinstance(self.mean, list) else len(self.mean.layout)


@dataclasses.dataclass(frozen=True)
class Decision:
    """How round ``round`` closed, as data: everything its merge reads besides the pushes'
    values. The pushes of ``learners`` (ascending: the merge's order), known by their ``ids``,
    each with its ``weights`` (its examples), ``late`` (rounds behind: the merge multiplies its
    weight by ``syncer.late_weight`` that many times) and ``finite``; ``full``: a full round's
    examples when it closed (:meth:`~diloco_jax.learners.keeping.Keeper.full_round`, by which
    ``syncer.weigh_rounds`` scales the mean). With syncer shards (issue 62) the shard that
    decides sends it to the others, which merge exactly these pushes, in this order, with
    these weights: the same round on every shard."""

    round: int
    learners: tuple[int, ...]
    ids: tuple[str, ...]
    weights: tuple[float, ...]
    late: tuple[int, ...]
    finite: tuple[bool, ...]
    full: float

    @classmethod
    def of(cls, rnd: int, order: list[int], pushes: list[Push], full: float) -> Decision:
        return cls(rnd, tuple(order), tuple(p.id for p in pushes),
                   tuple(float(p.weight) for p in pushes), tuple(p.late for p in pushes),
                   tuple(bool(p.finite) for p in pushes), float(full))  # fmt: skip

    def merge_weights(self, late_weight: float) -> list[float]:
        """Each push's weight in the merge: its examples x ``late_weight`` per round late."""
        return [w * late_weight**k for w, k in zip(self.weights, self.late, strict=True)]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> Decision:
        return cls(int(fields["round"]), tuple(int(i) for i in fields["learners"]),
                   tuple(str(i) for i in fields["ids"]),
                   tuple(float(w) for w in fields["weights"]),
                   tuple(int(k) for k in fields["late"]),
                   tuple(bool(f) for f in fields["finite"]), float(fields["full"]))  # fmt: skip


def charted(rnd: int, order: list[int], pushes: list[Push], waited: float, bytes_in: int,
            bytes_out: int) -> dict[str, Any]:  # fmt: skip
    """Round ``rnd`` as the status page charts it (JSON): the seconds it stood open, the bytes
    in and out since the round before closed, its learners (``order``: each of ``pushes``'),
    the late ones, and each learner's training loss as its push said (by learner, a string)."""
    return {
        "round": rnd, "waited": round(waited, 3), "bytes_in": bytes_in, "bytes_out": bytes_out,
        "learners": order, "late": [i for i, p in zip(order, pushes, strict=True) if p.late],
        "losses": {str(i): p.loss for i, p in zip(order, pushes, strict=True)
                   if p.loss is not None},
    }  # fmt: skip


SUSPECT_WINDOW = 8  # merged rounds a learner's suspicion looks back over
SUSPECT_AFTER = 3  # the fewest of them it needs (one odd round is no pattern)
FAR = 3.0  # a push this many times the round's median distance from the merge is an outlier


def outliers(stats: dict[str, list], rule) -> list[bool]:
    """Which of a robust merge's pushes (``stats``: :func:`robust_merge`'s, in the merge's
    order) it treated as outliers: clipped (``merge.clip``), trimmed on more of its coordinates
    than halfway from an honest push's expected share (``2 f / n``) to all of them, or (3 or
    more pushes) farther from the merged update than :data:`FAR` x the round's median
    distance (what shows an outlier under the median, whose rule marks nothing)."""
    n = len(stats["norm"])
    distance = np.asarray(stats["distance"], np.float64)
    middle = float(np.median(distance))
    limit = FAR * middle if n >= 3 and middle > 0 else np.inf
    f = min(rule.trim, (n - 1) // 2) if rule.rule == "trimmed_mean" else 0
    half = (1 + 2 * f / n) / 2
    return [
        bool(c) or (f > 0 and t > half) or bool(d > limit)
        for c, t, d in zip(stats["clipped"], stats["trimmed"], distance, strict=True)
    ]


def suspect(window) -> bool:
    """A learner whose last merged rounds (``window``: one bool per round, True where it was
    an outlier: :func:`outliers`) are outliers in most of them, once it has
    :data:`SUSPECT_AFTER` or more."""
    window = list(window)
    return len(window) >= SUSPECT_AFTER and 2 * sum(window) > len(window)


def sha256(leaves: list) -> str:
    """The SHA-256 (hex) of a list of arrays' little-endian bytes one after another: a wire
    message's checksum of them (:func:`.wire.encode`), and in short the tape's anchor hash.
    Read in place, without a copy."""
    h = hashlib.sha256()
    for x in leaves:
        h.update(wire.bytes_of(np.asarray(x)).data)
    return h.hexdigest()


def merge(pushes: list[Push], finish=None) -> tuple[list, float]:
    """The pushes' mean weighted by their examples: ``sum_l (w_l / W) m_l`` in float32, in
    learner order (each weight divided first, so equal weights scale exactly and one
    learner's mean passes unchanged); leaves out pushes that are not finite. Leaf by leaf:
    each push's leaf is read when its turn comes (from its file, for a push the network
    brought), so memory is the mean and one leaf, whatever the number of pushes; each value's
    sum is taken in the same order as push by push. ``finish(leaf, total_w)``, if given, turns
    each leaf of the mean into what is returned as soon as it is summed (the syncer scales it
    and moves it to the device, so the whole mean is never held twice)."""
    finite = [p for p in pushes if p.finite and p.weight > 0]
    total_w = sum(p.weight for p in finite)
    finish = finish or (lambda leaf, _: leaf)
    if not finite:
        return [finish(np.zeros(x.shape, np.float32), 0.0) for x in pushes[0].leaves()], 0.0
    shares = [np.float32(p.weight / total_w) for p in finite]
    total = []
    for i in range(finite[0].count()):
        acc = None
        for share, p in zip(shares, finite, strict=True):
            part = p.leaf(i)
            if isinstance(p.mean, list):  # the caller's array: not written to
                part = share * part
            else:  # read fresh from its file: scaled in place
                part *= share
            if acc is None:
                acc = part
            else:
                acc += part  # the same two float32 roundings as acc + (share * x)
        total.append(finish(acc, total_w))
    return total, total_w


def robust_merge(pushes: list[Push], rule, finish=None,
                 center: list | None = None) -> tuple[list, float, dict, list | None]:  # fmt: skip
    """:func:`merge` with a robust rule (a :class:`~diloco_jax.algorithm.robust.Merge` that is
    not the plain mean): the same :func:`~diloco_jax.algorithm.robust.combine` the simulator's
    exchange applies, over the finite pushes of weight > 0 in learner order, each leaf of
    every push stacked when its turn comes (memory: the pushes' largest leaf times their
    number, and the result). ``center``: centered clipping's (the last merge of these leaves,
    float32; None: zeros). Returns ``(mean, total weight, what the merge did to each push:
    robust.diagnose's, by the pushes' order among those merged, the next center)``: under
    centered clipping the merge itself, before ``finish`` (the old center where no push
    counted, as the simulator's exchange keeps it), else None."""
    import jax.numpy as jnp

    from diloco_jax.algorithm import robust

    finite = [p for p in pushes if p.finite and p.weight > 0]
    finish = finish or (lambda leaf, _: leaf)
    centered = rule.rule == "centered_clip"
    if centered and center is None:
        center = [np.zeros(x.shape, np.float32) for x in pushes[0].leaves()]
    if not finite:
        zeros = [finish(np.zeros(x.shape, np.float32), 0.0) for x in pushes[0].leaves()]
        return zeros, 0.0, {}, center if centered else None
    w_R = jnp.asarray([p.weight for p in finite], jnp.float32)
    valid_R = jnp.ones(len(finite), bool)
    stacked = robust.Lazy(finite[0].count(), lambda i: jnp.asarray(np.stack(
        [np.asarray(p.leaf(i), np.float32) for p in finite])))  # fmt: skip
    start = [jnp.asarray(c, jnp.float32) for c in center or []] if centered else None
    out = robust.combine(rule, stacked, w_R, valid_R, start)
    stats = robust.diagnose(rule, stacked, w_R, valid_R, out)
    total_w = float(sum(p.weight for p in finite))
    merged = [np.array(o, np.float32) for o in out]
    following = [m.copy() for m in merged] if centered else None  # ``finish`` may scale in place
    mean = [finish(m, total_w) for m in merged]
    return mean, total_w, {k: np.asarray(v).tolist() for k, v in stats.items()}, following
