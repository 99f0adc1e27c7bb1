"""What a syncer holds and how it keeps it: the members, the open round and its pushes, the
anchor and outer state (JAX arrays), and a round's close: the pushes merged in learner order,
the core's outer step, the checkpoint written, off the lock in a writer thread of its own,
and only then the round advanced and the new anchor answered. The rules that decide who may
push and when a round closes are :class:`diloco_jax.learners.syncer.Syncer`'s."""

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

from diloco_jax.learners.ledger import Ledger
from diloco_jax.learners.rounds import Member, Push, merge, sha256
from diloco_jax.learners.store import Store

log = logging.getLogger("diloco_jax")


class Keeper:
    """The syncer's state and its close of a round (see the module's docstring), without the
    rules (:class:`~diloco_jax.learners.syncer.Syncer`) or the network.

    ``algorithm``: the core's :class:`~diloco_jax.algorithm.Diloco` built from the syncer's
    config; ``outer_scale``: what multiplies its outer update (the outer learning rate where
    the optimizer is built with rate 1, as in a run); ``keys``: the training keys every learner
    must share (its config's, compared at join); ``learners``: the declared learner count;
    the rest as the ``syncer.*`` keys of the same names (see
    :mod:`diloco_jax.learners.syncer`)."""

    HISTORY = 8  # rounds the adaptive grace window remembers

    def __init__(self, algorithm, workdir: pathlib.Path, *, keys: dict, learners: int,
                 timeout: float, dead_after: float, quorum: int = 0, grace: float = 10.0,
                 adaptive_grace: bool = True, max_late: int = 4, rounds: int = 0,
                 examples: float = 0.0, outer_scale: float = 1.0, codec=None,
                 weigh_rounds: bool = False, late_weight: float = 1.0,
                 answer_mean: bool = False, clock=time.monotonic):  # fmt: skip
        self.algorithm, self.keys, self.learners = algorithm, keys, learners
        self.codec = codec  # how pushes travel (:mod:`.payload`; None: float32)
        self.weigh_rounds = weigh_rounds
        # outer.mode = eager: a push is answered with its round's merged mean (the learners take
        # their own outer steps); the syncer's anchor moves as in a synchronous run, for joins
        self.answer_mean = answer_mean
        self.means: dict[int, list] = {}  # the merged mean of each recent round
        self.late_weight = late_weight  # a push's merge weight times this per round it is late
        self.full_push: dict[int, float] = {}  # each learner's largest push: its whole weight
        self.timeout, self.dead_after, self.outer_scale = timeout, dead_after, outer_scale
        self.quorum, self.grace, self.adaptive_grace = quorum, grace, adaptive_grace
        self.max_late, self.rounds, self.examples = max_late, rounds, examples
        self.merged = 0.0  # examples whose pseudo-gradients reached the anchor, in all rounds
        self.clock = clock
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Condition()
        self.members: dict[int, Member] = {}
        self.pending: dict[int, Push] = {}
        self.round = 0
        self.names: list[str] = []  # the anchor's leaves, by name (empty: no anchor yet)
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
        self._restore()

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
        outer = jax.eval_shape(self.algorithm.outer.init, self._like(meta)["anchor"])
        self.outer_state = jax.tree.unflatten(jax.tree.structure(outer), saved["outer"])
        self.round, self.merged = step, float(meta.get("merged", 0.0))
        self.ledger = Ledger.from_meta(meta.get("pushes", {}))
        # the members of the last round, present again: their pushes need no new join
        for i, generation in meta.get("members", {}).items():
            self.members[int(i)] = Member(int(generation), step, self.clock())
        self.event("restored", anchor=self.anchor_sha[:16], members=sorted(self.members))

    def _like(self, meta: dict) -> dict:
        """The structure of a checkpoint's state, from its ``meta``."""
        anchor = [jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for _, s, d in meta["leaves"]]
        outer = jax.eval_shape(self.algorithm.outer.init, anchor)
        return {"anchor": anchor, "outer": jax.tree.leaves(outer)}

    def _save(self, rnd: int, anchor: list, outer_state, meta: dict) -> None:
        self.store.save(rnd, anchor, outer_state, meta)

    def _meta(self, rnd: int, anchor: list) -> dict:
        described = [[n, list(a.shape), str(a.dtype)]
                     for n, a in zip(self.names, anchor, strict=True)]  # fmt: skip
        members = {str(i): self.members[i].generation for i in self.present()}
        return {"leaves": described, "keys": self.keys, "round": rnd, "members": members,
                "merged": self.merged, "pushes": self.ledger.to_meta()}  # fmt: skip

    def _described(self) -> list[list]:
        return [[n, list(a.shape), str(a.dtype)]
                for n, a in zip(self.names, self.anchor or [], strict=True)]  # fmt: skip

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
        return sum(self.full_push.get(i, typical) for i in range(self.learners))

    def _outer_step(self, mean, anchor, outer_state, anyone):
        mean = [m.astype(a.dtype) for m, a in zip(mean, anchor, strict=True)]
        return self.algorithm.outer_step(mean, anchor, outer_state, self.outer_scale, anyone)

    def _settle(self) -> None:
        """Waits (the lock released meanwhile) until no round is being closed."""
        while self._closing:
            self.lock.wait(0.05)

    def _close(self, why: str) -> None:
        """Closes the open round: its pushes leave ``pending`` now; the merge, outer step and
        checkpoint follow off the lock (:meth:`_finish_close`), and only then does the round
        advance and the new anchor go out."""
        order = sorted(self.pending)
        pushes = [self.pending[i] for i in order]
        self.waited += self.clock() - (self._opened or self.clock())
        if self._quorum_at is not None:
            self._history.append(max(self._lags, default=0.0))
        self.pending, self.deadline, self._opened = {}, None, None
        self.expected, self._quorum_at, self._lags = set(), None, []
        self._closing = why
        if not self.background:
            self._finish_close(order, pushes, why, locked=True)
            return
        self._writer.submit(self._finish_close, order, pushes, why)

    def _finish_close(self, order: list[int], pushes: list[Push], why: str,
                      locked: bool = False) -> None:  # fmt: skip
        try:
            self._commit(order, pushes, why, locked)
        except Exception as e:  # noqa: BLE001 - said; the round's pushes are lost
            log.exception("syncer: closing round %d failed", self.round)
            self.event("close_failed", error=f"{type(e).__name__}: {str(e)[:200]}")
            with self.lock:
                self._closing = None
                self.lock.notify_all()

    def _commit(self, order: list[int], pushes: list[Push], why: str, locked: bool) -> None:
        """Merges ``pushes`` (of learners ``order``), takes the outer step, writes the
        checkpoint and advances the round. The old anchor and outer state are let go as soon as
        the new ones exist (nothing reads them while a round closes), so the checkpoint is
        written with the model held about three times: anchor, outer state, and what the write
        itself takes."""
        timer = time.perf_counter()
        examples = sum(p.weight for p in pushes if p.finite)
        full = self.full_round()

        def finish(leaf: np.ndarray, total_w: float) -> jax.Array:
            if self.weigh_rounds:  # a thin round moves the anchor less, one with late work more
                share = np.float32(total_w / full)
                leaf *= share  # in place: the same rounding as share * leaf
            return jnp.asarray(leaf)  # on the device leaf by leaf: the mean is held once

        mean, total_w = merge([dataclasses.replace(p, weight=p.weight * self.late_weight**p.late)
                               for p in pushes], finish)  # fmt: skip
        merged_s = time.perf_counter() - timer
        # eager: the mean is kept for the answers (a copy: the step takes the mean's buffers)
        kept = [np.array(m, np.float32) for m in mean] if self.answer_mean else None
        with warnings.catch_warnings():  # a bfloat16 anchor cannot take a float32 buffer
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            anchor, outer = self._step(mean, self.anchor, self.outer_state,
                                       anyone=bool(total_w > 0))  # fmt: skip
        del mean
        anchor = list(anchor)
        anchor_sha = sha256(anchor)
        step_s = time.perf_counter() - timer - merged_s
        closed = self.round
        with contextlib.nullcontext() if locked else self.lock:
            self.anchor, self.outer_state, self.anchor_sha = anchor, outer, anchor_sha
            self.ledger.merged(dict(zip(order, pushes, strict=True)), closed,
                               closed - self.max_late - 1)  # fmt: skip
            self.merged += examples
            meta = self._meta(closed + 1, anchor)
        try:
            self._save(closed + 1, anchor, outer, meta)  # before anyone sees the new anchor
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
                       late=[i for i, p in zip(order, pushes, strict=True) if p.late],
                       weights=[p.weight for p in pushes], total_weight=total_w,
                       anchor=anchor_sha[:16], merge_s=round(merged_s, 4),
                       step_s=round(step_s, 4), checkpoint_s=round(saved_s, 4))  # fmt: skip
            self._closing = None
            self.lock.notify_all()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.store.close()
