"""The syncer: holds the anchor (the outer parameters) and the outer optimizer's state of
independent learners, and takes the outer step when a round closes.

A round ``r`` collects one push per learner: its mean pseudo-gradient against the anchor of
round ``r``, with its weight (the examples it trained on). Synchronous rounds
(``syncer.mode = sync``) close when every present learner has pushed, or at the round's
deadline (``syncer.timeout`` seconds after its first push), when the silent ones are dropped.
Closing a round: the pushes' weighted mean (float32, in learner order), the outer step of the
core (:meth:`diloco_jax.algorithm.Diloco.outer_step`, the same optax transform and learning
rate as a run's sync), the new anchor and outer state written with orbax (atomically) under
``WORKDIR/checkpoints/<round>``, and only then the new anchor sent to the learners that wait
for it. A restarted syncer reads its newest checkpoint and goes on from that round.

The rules, each one line in the tape (``WORKDIR/syncer.jsonl``, one JSON object per event):
- a learner joins at any time and receives the current anchor and round; the first learner to
  join a syncer with no checkpoint brings the initial anchor. A learner whose parameters
  (names, shapes, dtypes) or training keys differ is refused, naming the first difference.
- a learner index that joins again gets a new generation; pushes of the old one are refused.
- a push against an older round than the current one (the learner missed a round) is refused
  as stale: the learner restarts from the current anchor (its work since is lost; quorum
  rounds, which merge late work, are not built yet).
- a learner silent for ``syncer.dead_after`` seconds (no push, no heartbeat) is dropped at the
  next check; a dropped learner's push is refused until it joins again.
- a push whose values are not all finite is left out of the round (the core's NaN guard).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import pathlib
import threading
import time
from typing import Any

import jax
import numpy as np

from diloco_jax.learners import wire
from diloco_jax.runtime import checkpoint

log = logging.getLogger("diloco_jax")


class Refused(ValueError):
    """A request the syncer turns down; the message says why (sent back to the learner)."""


@dataclasses.dataclass
class Member:
    generation: int
    joined_round: int
    last_seen: float
    status: str = "present"  # present | dropped | left
    pushes: int = 0


@dataclasses.dataclass
class Push:
    generation: int
    weight: float
    mean: list  # float32 leaves, in the anchor's order
    finite: bool


def digest(leaves: list) -> str:
    """A short hash of a list of arrays (the tape's anchor hash)."""
    h = hashlib.sha256()
    for x in leaves:
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


class Syncer:
    """The syncer's state and rules, without the network (the gRPC service wraps it).

    ``algorithm``: the core's :class:`~diloco_jax.algorithm.Diloco` built from the syncer's
    config; ``outer_scale``: what multiplies its outer update (the outer learning rate where
    the optimizer is built with rate 1, as in a run); ``keys``: the training keys every learner
    must share (its config's, compared at join); ``learners``: the declared learner count."""

    def __init__(self, algorithm, workdir: pathlib.Path, *, keys: dict, learners: int,
                 timeout: float, dead_after: float, outer_scale: float = 1.0,
                 clock=time.monotonic):  # fmt: skip
        self.algorithm, self.keys, self.learners = algorithm, keys, learners
        self.timeout, self.dead_after, self.outer_scale = timeout, dead_after, outer_scale
        self.clock = clock
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Condition()
        self.members: dict[int, Member] = {}
        self.pending: dict[int, Push] = {}
        self.round = 0
        self.names: list[str] = []  # the anchor's leaves, by name (empty: no anchor yet)
        self.anchor: list[np.ndarray] | None = None
        self.outer_state: Any = None
        self.deadline: float | None = None
        self.bytes_in = self.bytes_out = 0
        self.waited = 0.0  # seconds rounds stood open
        self._opened: float | None = None
        self._tape = (self.workdir / "syncer.jsonl").open("a")
        self._mngr = checkpoint.manager(self.workdir, max_to_keep=3)
        self._step = jax.jit(self._outer_step)
        self._restore()

    # ---- the tape, the checkpoint ------------------------------------------------------------

    def event(self, kind: str, **fields) -> None:
        line = {"event": kind, "round": self.round, "time": time.time(), **fields}
        self._tape.write(json.dumps(line) + "\n")
        self._tape.flush()
        log.info("syncer: %s %s", kind, " ".join(f"{k}={v}" for k, v in fields.items()))

    def _restore(self) -> None:
        step = self._mngr.latest_step()
        if step is None:
            return
        meta = checkpoint.saved_meta(self._mngr, step)
        described = meta["config"]["leaves"]
        like_anchor = [jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for _, s, d in described]
        like_outer = jax.eval_shape(self.algorithm.outer.init, like_anchor)
        like = {"anchor": like_anchor, "outer": jax.tree.leaves(like_outer)}
        saved = checkpoint.restore(self._mngr, like, step)
        self.names = [n for n, _, _ in described]
        self.anchor = [np.asarray(x) for x in saved["anchor"]]
        self.outer_state = jax.tree.unflatten(jax.tree.structure(like_outer), saved["outer"])
        self.round = step
        self.event("restored", anchor=digest(self.anchor))

    def _save(self) -> None:
        state = {"anchor": self.anchor, "outer": jax.tree.leaves(self.outer_state)}
        assert self.anchor is not None
        described = [[n, list(a.shape), str(a.dtype)]
                     for n, a in zip(self.names, self.anchor, strict=True)]  # fmt: skip
        meta = {"leaves": described, "keys": self.keys, "round": self.round}
        checkpoint.save(self._mngr, self.round, state, meta, wait=True)

    # ---- what learners ask ------------------------------------------------------------------

    def join(self, learner: int, describe: list, keys: dict, anchor: dict[str, np.ndarray]):
        """Admits ``learner`` (its parameters described by :func:`wire.describe`, its training
        ``keys``; ``anchor``: its own, used only when the syncer has none yet); returns
        ``(generation, round, anchor by name)``. Raises :class:`Refused`."""
        if not 0 <= learner < self.learners:
            raise Refused(f"learner {learner} is not in [0, {self.learners}) (syncer.learners)")
        for key, value in self.keys.items():
            if keys.get(key) != value:
                raise Refused(f"{key} is {keys.get(key)!r} on learner {learner} but {value!r} "
                              "on the syncer")  # fmt: skip
        with self.lock:
            if self.anchor is None:
                self.names = [n for n, _, _ in describe]
                self.anchor = [np.asarray(anchor[n]) for n in self.names]
                self.outer_state = jax.device_get(self.algorithm.outer.init(self.anchor))
                self._save()  # round 0: a restarted syncer starts where its learners did
                self.event("initial_anchor", learner=learner, anchor=digest(self.anchor))
            mine = [[n, list(a.shape), str(a.dtype)]
                    for n, a in zip(self.names, self.anchor, strict=True)]  # fmt: skip
            problem = wire.first_mismatch(mine, describe)
            if problem:
                raise Refused(f"learner {learner}'s model differs from the syncer's: {problem}")
            old = self.members.get(learner)
            generation = 1 if old is None else old.generation + 1
            self.members[learner] = Member(generation, self.round, self.clock())
            dropped = self.pending.pop(learner, None)
            self.event("joined", learner=learner, generation=generation,
                       replaced_push=dropped is not None)  # fmt: skip
            self._close_if_due()
            return generation, self.round, dict(zip(self.names, self.anchor, strict=True))

    def heartbeat(self, learner: int, generation: int) -> int:
        """Marks ``learner`` alive; returns the current round. Raises :class:`Refused` for an
        old generation or a dropped learner (it must join again)."""
        with self.lock:
            member = self._member(learner, generation)
            member.last_seen = self.clock()
            self._check_deadlines()
            return self.round

    def leave(self, learner: int, generation: int) -> None:
        with self.lock:
            member = self._member(learner, generation)
            member.status = "left"
            self.pending.pop(learner, None)
            self.event("left", learner=learner, generation=generation)
            self._close_if_due()

    def push(self, learner: int, generation: int, base_round: int, weight: float,
             mean: dict[str, np.ndarray]) -> None:  # fmt: skip
        """Adds ``learner``'s mean pseudo-gradient against the anchor of ``base_round`` to the
        open round. Raises :class:`Refused` (stale, dropped, old generation, wrong leaves)."""
        with self.lock:
            member = self._member(learner, generation)
            member.last_seen = self.clock()
            if base_round < self.round:
                self.event("refused", learner=learner, reason="stale", base_round=base_round)
                raise Refused(f"stale: computed against round {base_round}, the syncer is at "
                              f"round {self.round}; restart from its anchor")  # fmt: skip
            if base_round > self.round:
                raise Refused(f"round {base_round} has not started (the syncer is at "
                              f"{self.round})")  # fmt: skip
            if learner in self.pending:
                return  # a retried push counts once
            leaves = []
            for name, a in zip(self.names, self.anchor or [], strict=True):
                if name not in mean or mean[name].shape != a.shape:
                    raise Refused(f"the push lacks {name} {list(a.shape)} or has another shape")
                leaves.append(np.asarray(mean[name], np.float32))
            finite = all(bool(np.isfinite(x).all()) for x in leaves)
            if not finite:
                self.event("not_finite", learner=learner)
            if not self.pending:
                self._opened = self.clock()
                self.deadline = self._opened + self.timeout
            self.pending[learner] = Push(generation, float(weight), leaves, finite)
            member.pushes += 1
            self.event("pushed", learner=learner, generation=generation, weight=weight,
                       finite=finite)  # fmt: skip
            self._close_if_due()

    def wait(self, after_round: int, timeout: float) -> tuple[int, dict[str, np.ndarray]]:
        """Blocks until the syncer is past ``after_round`` (or ``timeout`` seconds, checking the
        round's deadline meanwhile); returns ``(round, anchor by name)``."""
        end = self.clock() + timeout
        with self.lock:
            while self.round <= after_round:
                left = end - self.clock()
                if left <= 0:
                    break
                self.lock.wait(min(left, 0.05))
                self._check_deadlines()
            return self.round, dict(zip(self.names, self.anchor or [], strict=True))

    # ---- rounds -----------------------------------------------------------------------------

    def _member(self, learner: int, generation: int) -> Member:
        member = self.members.get(learner)
        if member is None or member.generation != generation:
            raise Refused(f"learner {learner} generation {generation} is not a member (an old "
                          "connection, or never joined): join again")  # fmt: skip
        if member.status != "present":
            raise Refused(f"learner {learner} was {member.status}: join again")
        return member

    def present(self) -> list[int]:
        return sorted(i for i, m in self.members.items() if m.status == "present")

    def _check_deadlines(self) -> None:
        now = self.clock()
        for i in self.present():
            m = self.members[i]
            if i not in self.pending and now - m.last_seen > self.dead_after:
                m.status = "dropped"
                self.event("dropped", learner=i, reason=f"silent for {now - m.last_seen:.1f}s")
        if self.pending and self.deadline is not None and now >= self.deadline:
            for i in self.present():
                if i not in self.pending:
                    self.members[i].status = "dropped"
                    self.event("dropped", learner=i, reason="no push by the round's deadline")
        self._close_if_due()

    def _close_if_due(self) -> None:
        if not self.pending or any(i not in self.pending for i in self.present()):
            return
        self._close()

    @staticmethod
    def _merge(pushes: list[Push]) -> tuple[list, float]:
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

    def _outer_step(self, mean, anchor, outer_state, anyone):
        mean = [m.astype(a.dtype) for m, a in zip(mean, anchor, strict=True)]
        return self.algorithm.outer_step(mean, anchor, outer_state, self.outer_scale, anyone)

    def _close(self) -> None:
        order = sorted(self.pending)
        pushes = [self.pending[i] for i in order]
        mean, total_w = self._merge(pushes)
        anchor, outer = self._step(mean, self.anchor, self.outer_state, total_w > 0)
        self.anchor = [np.asarray(x) for x in jax.device_get(anchor)]
        self.outer_state = jax.device_get(outer)
        self.waited += self.clock() - (self._opened or self.clock())
        closed = self.round
        self.round += 1
        self._save()  # before anyone sees the new anchor
        self.event("closed", closed=closed, learners=order,
                   weights=[p.weight for p in pushes], total_weight=total_w,
                   anchor=digest(self.anchor))  # fmt: skip
        self.pending, self.deadline, self._opened = {}, None, None
        self.lock.notify_all()

    def status(self) -> dict[str, Any]:
        """What the status page and ``/metrics`` show."""
        with self.lock:
            return {
                "round": self.round, "learners": self.learners, "mode": "sync",
                "timeout": self.timeout, "dead_after": self.dead_after,
                "members": {i: dataclasses.asdict(m) for i, m in sorted(self.members.items())},
                "pending": sorted(self.pending), "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "waited_seconds": round(self.waited, 3),
            }  # fmt: skip

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
        self._tape.close()
