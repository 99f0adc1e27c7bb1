"""What a syncer holds and how it keeps it: the members, the open round and its pushes, the
anchor and outer state (JAX arrays), and a round's close: the pushes merged in learner order,
the core's outer step, the checkpoint written, off the lock in a writer thread of its own,
and only then the round advanced and the new anchor answered. The rules that decide who may
push and when a round closes are :class:`diloco_jax.learners.syncer.Syncer`'s.

Streaming DiLoCo (``streaming.fragments`` F > 1): round ``r`` is the sync of one fragment, the
one the core's plan starts at the learners' ``r``-th sync
(:meth:`~diloco_jax.algorithm.plan.SyncPlan.round_fragment`); its pushes, merge, outer step
(with that fragment's own outer state: the outer state is the tuple of the fragments') and
answer hold that fragment's leaves. Which leaf is in which fragment the first learner's join
says (the learners' ``fragment_of``), and every later join must agree."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import pathlib
import shutil
import threading
import time
import warnings
from collections import deque
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.learners import answers
from diloco_jax.learners.ledger import Ledger
from diloco_jax.learners.rounds import (
    SUSPECT_WINDOW,
    Decision,
    Member,
    Push,
    charted,
    merge,
    outliers,
    robust_merge,
    sha256,
    suspect,
)
from diloco_jax.learners.store import Store

log = logging.getLogger("diloco_jax")


class Keeper:
    """The syncer's state and its close of a round (see the module's docstring), without the
    rules (:class:`~diloco_jax.learners.syncer.Syncer`) or the network.

    ``algorithm``: the core's :class:`~diloco_jax.algorithm.Diloco` built from the syncer's
    config; ``outer_scale``: what multiplies its outer update (the outer learning rate where
    the optimizer is built with rate 1, as in a run); ``keys``: the training keys every learner
    must share (its config's, compared at join); ``learners``: the declared learner count;
    ``compress_answers``: ``compress.answers``, the answers through ``codec``
    (:mod:`diloco_jax.learners.answers`: the syncer's outer step goes on from its true anchor,
    the learners' replicas restart from ``sent``, their reconstruction of it); the rest as the
    ``syncer.*`` keys of the same names (see :mod:`diloco_jax.learners.syncer`)."""

    HISTORY = 8  # rounds the adaptive grace window remembers
    ROUNDS_SHOWN = 256  # closed rounds the status page charts (in each checkpoint too)

    def __init__(self, algorithm, workdir: pathlib.Path, *, keys: dict, learners: int,
                 timeout: float, dead_after: float, quorum: int = 0, grace: float = 10.0,
                 adaptive_grace: bool = True, max_late: int = 4, rounds: int = 0,
                 examples: float = 0.0, outer_scale: float = 1.0, codec=None,
                 weigh_rounds: bool = False, late_weight: float = 1.0,
                 answer_mean: bool = False, compress_answers: bool = False,
                 clock=time.monotonic, decides: bool = True,
                 removed: tuple[int, ...] = ()):  # fmt: skip
        self.algorithm, self.keys, self.learners = algorithm, keys, learners
        # issue 63: learners the operator removed from the run (``syncer.drop``, and those of
        # the checkpoint: a learner removed once stays removed), refused from then on
        self.removed: set[int] = set(removed)
        rule = getattr(algorithm, "merge", None)
        # merge.rule = centered_clip (issue 63): each leaf's center, its last merge (float32,
        # in the checkpoint; None: zeros, before any merge), as the simulator's exchange keeps
        # it per fragment
        self.centered = rule is not None and rule.rule == "centered_clip"
        self.center: list[np.ndarray] | None = None
        # a shard that does not decide (issue 62) closes a round only as the deciding shard's
        # decision says (:meth:`Syncer.follow`); the recent decisions, by round
        self.decides = decides
        self.decisions: dict[int, Decision] = {}
        self.fragments = algorithm.plan.fragments  # Streaming DiLoCo's F (1: plain DiLoCo)
        self.codec = codec  # how pushes travel (:mod:`.payload`; None: float32; or DctConfig)
        self.weigh_rounds = weigh_rounds
        # outer.mode = eager: a push is answered with its round's merged mean (the learners take
        # their own outer steps); the syncer's anchor moves as in a synchronous run, for joins
        self.answer_mean = answer_mean
        # compress.answers: the anchor's change through the codec, error feedback kept here
        # (:mod:`.answers`); ``sent``: what the learners hold of the anchor
        if compress_answers:
            answers.check(codec, answer_mean, algorithm.plan.fragments)
        self.compress_answers = compress_answers
        self.sent: answers.Sent | None = None
        self.means: dict[int, list] = {}  # the merged mean of each recent round
        self.late_weight = late_weight  # a push's merge weight times this per round it is late
        self.full_push: dict[int, float] = {}  # each learner's largest push: its whole weight
        self.timeout, self.dead_after, self.outer_scale = timeout, dead_after, outer_scale
        self.quorum, self.grace, self.adaptive_grace = quorum, grace, adaptive_grace
        if quorum and self.fragments > 1:
            raise ValueError("syncer.quorum > 0 does not combine with streaming fragments (a "
                             "late push holds another round's fragment)")  # fmt: skip
        self.max_late, self.rounds, self.examples = max_late, rounds, examples
        self.merged = 0.0  # examples whose pseudo-gradients reached the anchor, in all rounds
        self.clock = clock
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Condition()
        self.members: dict[int, Member] = {}
        self.capacity: dict[int, float] = {}  # the most a learner's push may weigh (its join's)
        # issue 63: under a robust merge, whether each learner was an outlier in its last
        # merged rounds (:func:`.rounds.outliers`), by learner
        self.outlying: dict[int, deque[bool]] = {}
        self.pending: dict[int, Push] = {}
        self.round = 0
        self.names: list[str] = []  # the anchor's leaves, by name (empty: no anchor yet)
        self.assignment: list[int] = []  # the fragment of each leaf (set with the anchor)
        # the anchor and outer state live as JAX arrays (the outer step's inputs as they are;
        # a learner's answer reads the anchor in place)
        self.anchor: list[jax.Array] | None = None
        self.anchor_sha = ""  # the SHA-256 of the anchor's bytes: the answers' checksum
        self.outer_state: Any = None
        self.deadline: float | None = None
        self.expected: set[int] = set()  # the learners the open round waits for
        self._quorum_at: float | None = None  # when the open round reached its quorum
        self._grace_now = grace  # the grace window of the open round
        self._lags: list[float] = []  # seconds after the quorum of this round's later pushes
        self._history: deque[float] = deque(maxlen=self.HISTORY)
        self.bytes_in = self.bytes_out = 0
        self.waited = 0.0  # seconds rounds stood open
        self._opened: float | None = None
        # the last closed rounds as the status page charts them (:func:`.rounds.charted`)
        self.past: deque[dict] = deque(maxlen=self.ROUNDS_SHOWN)
        self._bytes_at = (0, 0)  # bytes in and out when the last round closed
        self.ledger = Ledger()  # pushes by id: on their way, merged (exactly once)
        self._closing: str | None = None  # a round being merged and written, off the lock
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="close")
        self.incoming = self.workdir / "incoming"  # pushes as they stream in (:mod:`.intake`)
        shutil.rmtree(self.incoming, ignore_errors=True)  # an open round's: its pushes come again
        self.incoming.mkdir()
        self.store = Store(self.workdir)
        # the mean's and the outer state's buffers are given to the new anchor and outer state
        # (not the anchor's: an answer on its way may still be reading it)
        # (``anyone`` static: XLA drops the guard's select, and the copies it would hold)
        self._step = jax.jit(self._outer_step, donate_argnums=(0, 2), static_argnames="anyone")
        self._removed_before: set[int] = set()  # those the checkpoint says were removed
        self._restore()
        for i in sorted(self.removed - self._removed_before):
            self.event("removed", learner=i, by="syncer.drop")

    background = True  # a round is closed in a thread of its own (the replay's: inline)

    def event(self, kind: str, **fields) -> None:
        self.store.event(kind, self.round, **fields)

    def _restore(self) -> None:
        """The newest readable checkpoint's round, anchor, outer state, members and merged
        pushes (a damaged one: the one before, :meth:`Store.restore`)."""
        got = self.store.restore(self._like)
        if got is None:
            return
        step, meta, saved = got
        self.names = [n for n, _, _ in meta["leaves"]]
        self.anchor = list(saved["anchor"])
        self.anchor_sha = sha256(self.anchor)
        self.assignment = self._assigned(meta)
        outer = self._outer_shape(self._like(meta)["anchor"], self.assignment)
        self.outer_state = jax.tree.unflatten(jax.tree.structure(outer), saved["outer"])
        self.round, self.merged = step, float(meta.get("merged", 0.0))
        if self.compress_answers and "sent" in saved:  # else the anchor: :meth:`_sent`
            self.sent = answers.first(list(saved["sent"]), step)
        if self.centered and "center" in saved:  # else zeros: no round merged yet
            self.center = [np.asarray(c, np.float32) for c in saved["center"]]
        self.ledger = Ledger.from_meta(meta.get("pushes", {}))
        # the members of the last round, present again: their pushes need no new join
        for i, generation in meta.get("members", {}).items():
            self.members[int(i)] = Member(int(generation), step, self.clock())
        self.capacity = {int(i): float(c) for i, c in meta.get("capacity", {}).items()}
        self.outlying = {int(i): deque(map(bool, w), maxlen=SUSPECT_WINDOW)
                         for i, w in meta.get("outlying", {}).items()}  # fmt: skip
        for i, member in self.members.items():
            member.suspect = suspect(self.outlying.get(i, ()))
        self._removed_before = {int(i) for i in meta.get("removed", [])}
        self.removed |= self._removed_before
        self.past.extend(meta.get("past_rounds", []))  # none in a checkpoint of before issue 61
        # how the recent rounds closed: a restarted deciding shard answers its followers
        self.decisions = {d.round: d for d in map(Decision.from_json, meta.get("decisions", []))}
        for i in self.removed & set(self.members):
            self.members[i].status = "removed"
        self.event("restored", anchor=self.anchor_sha[:16], members=sorted(self.members))

    def _like(self, meta: dict) -> dict:
        """The structure of a checkpoint's state, from its ``meta``."""
        anchor = [jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for _, s, d in meta["leaves"]]
        outer = self._outer_shape(anchor, self._assigned(meta))
        like = {"anchor": anchor, "outer": jax.tree.leaves(outer)}
        if meta.get("sent"):
            like["sent"] = anchor
        if meta.get("center"):
            like["center"] = [jax.ShapeDtypeStruct(a.shape, np.float32) for a in anchor]
        return like

    def _outer_shape(self, anchor: list, assignment: list[int]):
        return jax.eval_shape(lambda leaves: self.outer_init(leaves, assignment), anchor)

    def _assigned(self, meta: dict) -> list[int]:
        return list(meta.get("fragments") or [0] * len(meta["leaves"]))

    def outer_init(self, anchor: list, assignment: list[int]):
        """A fresh outer state of ``anchor`` (a list of leaves): the outer optimizer's state of
        the whole list, or with streaming fragments (``assignment``: each leaf's) the tuple of
        each fragment's, over the list of its leaves, as the core keeps them."""
        if self.fragments == 1:
            return self.algorithm.outer.init(anchor)
        groups = fragments_lib.groups(assignment, self.fragments)
        return tuple(self.algorithm.outer.init([anchor[i] for i in idx]) for idx in groups)

    def carried(self, rnd: int) -> list[int]:
        """The indices of the anchor's leaves that round ``rnd``'s pushes and answer hold: every
        leaf, or with streaming fragments those of the round's fragment."""
        if self.fragments == 1:
            return list(range(len(self.names)))
        fragment = self.algorithm.plan.round_fragment(rnd)
        return [i for i, f in enumerate(self.assignment) if f == fragment]

    def _save(self, rnd: int, anchor: list, outer_state, meta: dict, sent: list | None = None,
              center: list | None = None) -> None:  # fmt: skip
        groups = {}
        if sent is not None:  # compress.answers: the learners' anchor, restored with the rest
            meta, groups["sent"] = {**meta, "sent": True}, sent
        if center is not None:  # centered clipping's center
            meta, groups["center"] = {**meta, "center": True}, center
        self.store.save(rnd, anchor, outer_state, meta, groups)

    def _sent(self) -> answers.Sent | None:
        """``sent`` (compress.answers; None: off): what the learners hold of the anchor, the
        anchor itself until a round's change went out."""
        if self.compress_answers and self.sent is None and self.anchor is not None:
            self.sent = answers.first(self.anchor, self.round)
        return self.sent

    def held(self) -> dict[str, Any]:
        """The anchor a join is given, by name: with compress.answers the learners'
        reconstruction (``sent``, so that every learner holds the same), else the anchor."""
        sent = self._sent()
        leaves = (self.anchor or []) if sent is None else sent.leaves
        return dict(zip(self.names, leaves, strict=True))

    def _meta(self, rnd: int, anchor: list) -> dict:
        described = [[n, list(a.shape), str(a.dtype)]
                     for n, a in zip(self.names, anchor, strict=True)]  # fmt: skip
        members = {str(i): self.members[i].generation for i in self.present()}
        meta = {"leaves": described, "keys": self.keys, "round": rnd, "members": members,
                "merged": self.merged, "pushes": self.ledger.to_meta(),
                "capacity": {str(i): c for i, c in sorted(self.capacity.items())},
                "outlying": {str(i): list(w) for i, w in sorted(self.outlying.items())},
                "removed": sorted(self.removed),
                "past_rounds": list(self.past),
                "decisions": [d.to_json() for _, d in sorted(self.decisions.items())]}  # fmt: skip
        if self.fragments > 1:
            meta["fragments"] = self.assignment
        return meta

    def _described(self, rnd: int | None = None) -> list[list]:
        """The ``[name, shape, dtype]`` of the anchor's leaves, or of those a push of round
        ``rnd`` holds (:meth:`carried`)."""
        described = [[n, list(a.shape), str(a.dtype)]
                     for n, a in zip(self.names, self.anchor or [], strict=True)]  # fmt: skip
        return described if rnd is None else [described[i] for i in self.carried(rnd)]

    def answered(self, rnd: int) -> tuple[dict[str, Any], str | None]:
        """The anchor a push of round ``rnd`` is answered with, by name, and its SHA-256 where
        it is the whole anchor's (None: a fragment's, hashed as it is sent)."""
        leaves: list = self.anchor or []
        if self.fragments == 1:
            return dict(zip(self.names, leaves, strict=True)), self.anchor_sha
        return {self.names[i]: leaves[i] for i in self.carried(rnd)}, None

    @property
    def finished(self) -> bool:
        """The run's last round has closed (``syncer.rounds`` rounds, or ``syncer.examples``
        examples merged): pushes are no longer merged."""
        return (bool(self.rounds) and self.round >= self.rounds) or (
            bool(self.examples) and self.merged >= self.examples)  # fmt: skip

    def present(self) -> list[int]:
        return sorted(i for i, m in self.members.items() if m.status == "present")

    def full_round(self) -> float:
        """The examples of a round where every declared learner pushes its whole weight: each
        learner's largest push so far; one not seen yet counts as the mean of those seen."""
        seen = list(self.full_push.values())
        typical = sum(seen) / len(seen) if seen else 1.0
        return sum(self.full_push.get(i, typical) for i in range(self.learners)
                   if i not in self.removed)  # fmt: skip

    def _outer_step(self, mean, anchor, outer_state, anyone):
        mean = [m.astype(a.dtype) for m, a in zip(mean, anchor, strict=True)]
        return self.algorithm.outer_step(mean, anchor, outer_state, self.outer_scale, anyone)

    def _settle(self) -> None:
        """Waits (the lock released meanwhile) until no round is being closed."""
        while self._closing:
            self.lock.wait(0.05)

    def _close(self, why: str, decided: Decision | None = None) -> None:
        """Closes the open round: its pushes leave ``pending`` now; the merge, outer step and
        checkpoint follow off the lock (:meth:`_finish_close`), and only then does the round
        advance and the new anchor go out. ``decided``: the deciding shard's decision, whose
        pushes alone leave (the others wait for a later round, as there)."""
        order = sorted(self.pending) if decided is None else list(decided.learners)
        pushes = [self.pending[i] for i in order]
        rest = {i: p for i, p in self.pending.items() if i not in order}
        now = self.clock()
        waited = 0.0 if self._opened is None else now - self._opened  # (a test clock's 0.0 too)
        self.waited += waited
        shown = charted(self.round, order, pushes, waited, self.bytes_in - self._bytes_at[0],
                        self.bytes_out - self._bytes_at[1])  # fmt: skip
        self._bytes_at = (self.bytes_in, self.bytes_out)
        if self._quorum_at is not None:
            self._history.append(max(self._lags, default=0.0))
        self.pending, self.deadline, self._opened = rest, None, None
        self.expected, self._quorum_at, self._lags = set(), None, []
        self._closing = why
        # what the merge reads besides the values: a full round's examples counted now (no
        # push enters while the round closes), the rest from the pushes
        decision = decided or Decision.of(self.round, order, pushes, self.full_round())
        self.decisions = {r: d for r, d in self.decisions.items() if r >= self.round - 8}
        self.decisions[self.round] = decision
        if not self.background:
            self._finish_close(decision, pushes, why, shown, locked=True)
            return
        self._writer.submit(self._finish_close, decision, pushes, why, shown)

    def _finish_close(self, decision: Decision, pushes: list[Push], why: str, shown: dict,
                      locked: bool = False) -> None:  # fmt: skip
        try:
            self._commit(decision, pushes, why, shown, locked)
        except Exception as e:  # noqa: BLE001 - said; the round's pushes are lost
            log.exception("syncer: closing round %d failed", self.round)
            self.event("close_failed", error=f"{type(e).__name__}: {str(e)[:200]}")
            with self.lock:
                self._closing = None
                self.lock.notify_all()

    def _commit(self, decision: Decision, pushes: list[Push], why: str, shown: dict,
                locked: bool) -> None:  # fmt: skip
        """Merges ``pushes`` as ``decision`` says (its learners' order, weights, lateness,
        finiteness and full round: :class:`~.rounds.Decision`), takes the outer step, writes
        the checkpoint (``shown``: the round as the status page charts it, in :attr:`past`)
        and advances the round. The old anchor and outer state are let go as soon as
        the new ones exist (nothing reads them while a round closes), so the checkpoint is
        written with the model held about three times: anchor, outer state, and what the write
        itself takes."""
        timer = time.perf_counter()
        order, full = list(decision.learners), decision.full
        examples = sum(w for w, ok in zip(decision.weights, decision.finite, strict=True) if ok)

        def finish(leaf: np.ndarray, total_w: float) -> jax.Array:
            if self.weigh_rounds:  # a thin round moves the anchor less, one with late work more
                share = np.float32(total_w / full)
                leaf *= share  # in place: the same rounding as share * leaf
            return jnp.asarray(leaf)  # on the device leaf by leaf: the mean is held once

        weights = decision.merge_weights(self.late_weight)
        weighed = [dataclasses.replace(p, weight=w, finite=ok)
                   for p, w, ok in zip(pushes, weights, decision.finite, strict=True)]  # fmt: skip
        rule, diagnosed, center = getattr(self.algorithm, "merge", None), {}, None
        if rule is None or rule.plain:
            mean, total_w = merge(weighed, finish)
        else:  # issue 63: the simulator's rule; what it did to each push goes in the tape
            idx = self.carried(self.round)
            if self.centered:  # the round's leaves' center: their last merge
                center = self.center or [np.zeros(a.shape, np.float32) for a in self.anchor or []]
            part = None if center is None else [center[i] for i in idx]
            mean, total_w, stats, part = robust_merge(weighed, rule, finish, part)
            if center is not None and part is not None:
                center = list(center)
                for i, c in zip(idx, part, strict=True):
                    center[i] = c
            merged_order = [i for i, p in zip(order, weighed, strict=True)
                            if p.finite and p.weight > 0]  # fmt: skip
            if stats:
                stats["outlier"] = outliers(stats, rule)
            diagnosed = {"rule": rule.rule, **{k: dict(zip(map(str, merged_order), v,
                                                           strict=True))
                                              for k, v in stats.items()}}  # fmt: skip
        merged_s = time.perf_counter() - timer
        # eager: the mean is kept for the answers (a copy: the step takes the mean's buffers)
        kept = [np.array(m, np.float32) for m in mean] if self.answer_mean else None
        anchor, outer = self._fragment_step(self.round, mean, anyone=bool(total_w > 0))
        del mean
        anchor_sha = sha256(anchor)
        # compress.answers: the change the learners will add; the outer step goes on from the
        # true anchor, and what the codec lost goes out with the next round's change
        sent = self._sent()
        if sent is not None:
            sent = answers.following(sent, anchor, self.names, self.codec)
        step_s = time.perf_counter() - timer - merged_s
        closed = self.round
        with contextlib.nullcontext() if locked else self.lock:
            self.anchor, self.outer_state, self.anchor_sha = anchor, outer, anchor_sha
            self.sent = sent
            if center is not None:
                self.center = center
            self.ledger.merged(dict(zip(order, pushes, strict=True)), closed,
                               closed - self.max_late - 1)  # fmt: skip
            self.merged += examples
            self.past.append(shown)
            if diagnosed:
                diagnosed["suspects"] = self._suspected(diagnosed)
            meta = self._meta(closed + 1, anchor)
        try:
            self._save(closed + 1, anchor, outer, meta,  # before anyone sees the new anchor
                       None if sent is None else sent.leaves, center)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the round goes on; a restart would lose it
            log.exception("syncer: the checkpoint of round %d was not written", closed + 1)
            self.event("checkpoint_failed", error=f"{type(e).__name__}: {str(e)[:200]}")
        saved_s = time.perf_counter() - timer - merged_s - step_s
        for p in pushes:
            if not isinstance(p.mean, list):
                p.mean.remove()
        with contextlib.nullcontext() if locked else self.lock:
            if self.answer_mean:  # kept for the late pushes of the rounds after it
                self.means = {k: v for k, v in self.means.items()
                              if k >= closed - self.max_late}  # fmt: skip
                self.means[closed] = kept or []
            self.round = closed + 1
            if self.finished:
                self.event("finished", rounds=self.round, examples=self.merged)
            self.event("closed", closed=closed, learners=order, why=why,
                       late=[i for i, k in zip(order, decision.late, strict=True) if k],
                       weights=list(decision.weights), total_weight=total_w,
                       anchor=anchor_sha[:16], merge_s=round(merged_s, 4),
                       step_s=round(step_s, 4), checkpoint_s=round(saved_s, 4),
                       **({"merge": diagnosed} if diagnosed else {}))  # fmt: skip
            self._closing = None
            self.lock.notify_all()

    def _suspected(self, diagnosed: dict) -> list[int]:
        """Takes a robust merge's view of each push (``diagnosed``: the tape's, by learner)
        into its learner's membership and outlier window; returns the learners now suspect (an
        outlier in most of their last merged rounds: :func:`.rounds.suspect`), each newly
        flagged one said in a ``suspect`` line of the tape and the log."""
        for key in diagnosed.get("norm", {}):
            i = int(key)
            shown = {k: diagnosed[k][key] for k in ("norm", "distance", "clipped", "trimmed",
                                                    "outlier")}  # fmt: skip
            window = self.outlying.setdefault(i, deque(maxlen=SUSPECT_WINDOW))
            window.append(bool(shown["outlier"]))
            member = self.members.get(i)
            if member is None:
                continue
            was, member.merge = member.suspect, shown
            member.suspect = suspect(window)
            if member.suspect and not was:
                self.store.taped("suspect", self.round, learner=i, outliers=sum(window),
                                 rounds=len(window))  # fmt: skip
                log.warning("syncer: learner %d was an outlier of the merge in %d of its last %d "
                            "rounds: suspect (syncer.drop removes it from the run)",
                            i, sum(window), len(window))  # fmt: skip
        return sorted(i for i, m in self.members.items() if m.suspect)

    def _fragment_step(self, rnd: int, mean: list, anyone: bool) -> tuple[list, Any]:
        """``(anchor, outer state)`` after round ``rnd``'s outer step on its merged ``mean``:
        of the whole anchor, or with streaming fragments of the round's fragment alone (its
        leaves and its own outer state), the others' kept."""
        idx = self.carried(rnd)
        assert self.anchor is not None
        fragment = self.algorithm.plan.round_fragment(rnd)
        outer = self.outer_state if self.fragments == 1 else self.outer_state[fragment]
        with warnings.catch_warnings():  # a bfloat16 anchor cannot take a float32 buffer
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            part, outer = self._step(mean, [self.anchor[i] for i in idx], outer, anyone=anyone)
        anchor = list(self.anchor)
        for i, leaf in zip(idx, part, strict=True):
            anchor[i] = leaf
        if self.fragments > 1:
            outer = tuple(outer if f == fragment else s for f, s in enumerate(self.outer_state))
        return anchor, outer

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.store.close()
