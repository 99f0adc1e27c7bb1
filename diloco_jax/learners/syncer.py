"""The syncer: holds the anchor (the outer parameters) and the outer optimizer's state of
independent learners, and takes the outer step when a round closes.

A round ``r`` collects one push per learner: its mean pseudo-gradient against the anchor it
last received, with its weight (the examples it trained on). A round opens at its first push;
the learners present then are the ones it waits for (one that joins later joins the next round:
its join returns when the open round closes; a synchronous run's first round waits for every
declared learner, joined or not, so they start together). When a round closes:

- synchronous (``syncer.quorum = 0``): when every learner it waits for has pushed, or at its
  deadline (``syncer.timeout`` seconds after the first push), when the silent ones are dropped;
- quorum (``syncer.quorum = K``): when all have pushed, or ``K`` have pushed on time (late
  pushes do not count) and the grace window has passed since the K-th, or at the deadline
  (nobody is dropped: a learner that misses the round pushes late). The grace window is
  ``syncer.grace`` seconds, or with ``syncer.adaptive_grace`` 1.5 x the longest wait after the
  quorum that brought a push in any of the last 8 rounds, between 0.1 x and 1 x
  ``syncer.grace``: learners that come together are waited for, a chronic straggler is not
  (its work is merged a round late, not lost: waiting for it would hold every fast learner
  back).

Closing a round: the pushes' weighted mean (float32, in learner order), the outer step of the
core (:meth:`diloco_jax.algorithm.Diloco.outer_step`, the same optax transform and learning
rate as a run's sync), the new anchor and outer state written with orbax (atomically) under
``WORKDIR/checkpoints/<round>`` with the members, and only then the new anchor sent to the
learners that wait for it. A restarted syncer reads its newest checkpoint and goes on from that
round with the same members and generations (their pushes are accepted without a new join).

The rules, each one line in the tape (``WORKDIR/syncer.jsonl``, one JSON object per event):
- a learner joins at any time and receives the current anchor and round; the first learner to
  join a syncer with no checkpoint brings the initial anchor. A learner whose parameters
  (names, shapes, dtypes) or training keys differ is refused, naming the first difference.
- a learner index that joins again gets a new generation; pushes of the old one are refused.
- a push against the anchor of an older round (the learner missed a round): in synchronous
  rounds it is refused as stale and the learner restarts from the current anchor (its work
  since is lost); in quorum rounds it joins the open round with its weight, if it is at most
  ``syncer.max_late`` rounds behind, and its learner waits for that round to close, as the
  others do, so it goes on in step with them (a learner that went on from the open round's
  anchor at once would be late again at its next push, and every learner it delays too).
- a learner silent for ``syncer.dead_after`` seconds (no push, no heartbeat) is dropped at the
  next check; a dropped learner's push is refused until it joins again.
- a push whose values are not all finite is left out of the round (the core's NaN guard).
- a push may say its learner's mean training loss over the round (what the status page shows
  and charts, :attr:`past`); one that is not a finite number within ``guard.MAX_LOSS`` of 0
  is refused (a learner leaves such a loss out). Every refused push of a member is counted on
  it (``refused``).
- with ``syncer.weigh_rounds`` (the default), the merged mean is multiplied by the round's
  examples over a full round's (:meth:`Syncer.full_round`: every declared learner's largest
  push) before the outer step: the absent learners count as pseudo-gradients of zero, so the
  anchor moves in proportion to the examples merged, however thin or many the rounds (a round
  of every learner, whole, is unchanged).
- a late push's weight in the merge is multiplied by ``syncer.late_weight`` (0.5 by default)
  per round it is late: its pseudo-gradient was taken against an anchor that has moved since,
  by a step that already holds much of the same direction (1: its examples count in full; the
  examples budget counts them in full either way).
- every push carries an id: a push is merged at most once, whether it arrives once, twice,
  after its round closed or after the syncer restarted (the merged ids are in each round's
  checkpoint); a copy is answered with the result of the round its push went into. A different
  push for a slot already taken (the same learner, generation and round) is refused as a
  conflict, in the tape and the log.
- a learner dropped for silence in quorum rounds (a partition) that comes back with a push of
  its generation at most ``syncer.max_late`` rounds late is admitted again and its push merged
  late; in synchronous rounds it joins again, as before.
- with ``compress.answers`` the answer is the anchor's change through the codec, the error kept
  here: the learners restart from the anchor they rebuild (``sent``, in every checkpoint), the
  outer step goes on from the true one (:mod:`diloco_jax.learners.answers`).

The round's merge, outer step and checkpoint run off the lock (heartbeats, joins and status
are answered meanwhile); the new anchor is answered only once its checkpoint is written.

With syncer shards (``syncer.shards``, issue 62) each shard is a syncer of its part of the
anchor (:mod:`.shards`). Shard 0 applies every rule above and keeps each round's
:class:`~.rounds.Decision`; the others (``decides=False``) apply none that time sets off and
close a round only as shard 0's decision says (:meth:`Syncer.follow`, :mod:`.following`). A
push to a shard says whether the learner's whole mean is finite (``whole_finite``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import uuid
from typing import Any

import jax.numpy as jnp
import numpy as np

from diloco_jax.learners import answers, guard, payload, wire
from diloco_jax.learners.keeping import Keeper
from diloco_jax.learners.ledger import Ticket
from diloco_jax.learners.rounds import Decision, Member, Push, sha256

log = logging.getLogger("diloco_jax")


class Refused(ValueError):
    """A request the syncer turns down; the message says why (sent back to the learner)."""


class Syncer(Keeper):
    """The syncer's rules (see the module's docstring) over its state
    (:class:`~diloco_jax.learners.keeping.Keeper`, whose arguments it takes), without the
    network (the gRPC service wraps it)."""

    def join(self, learner: int, describe: list, keys: dict, anchor: dict[str, np.ndarray],
             fragments: list[int] | None = None, capacity: float | None = None):  # fmt: skip
        """Admits ``learner`` (its parameters described by :func:`wire.describe`, its training
        ``keys``; ``anchor``: its own, used only when the syncer has none yet; ``fragments``:
        with streaming fragments, the fragment of each of its leaves); returns
        ``(generation, round, anchor by name)``; ``capacity``: the examples it can train in a
        round (its replicas x rows per round), the most a push of its may weigh (None: not
        bounded). A learner the open round does not wait for
        joins the next round: this returns when the open one has closed. Raises
        :class:`Refused`."""
        if not 0 <= learner < self.learners:
            raise Refused(f"learner {learner} is not in [0, {self.learners}) (syncer.learners)")
        if learner in self.removed:
            raise Refused(self._removed_why(learner))
        for key, value in self.keys.items():
            if keys.get(key) != value:
                raise Refused(f"{key} is {keys.get(key)!r} on learner {learner} but {value!r} "
                              "on the syncer")  # fmt: skip
        with self.lock:
            self._settle()
            if self.anchor is None:
                self.names = [n for n, _, _ in describe]
                self.anchor = [jnp.asarray(anchor[n]) for n in self.names]
                self.anchor_sha = sha256(self.anchor)
                self.assignment = list(fragments or [0] * len(self.names))
                self.outer_state = self.outer_init(self.anchor, self.assignment)
                # round 0: a restarted syncer starts where its learners did
                self._save(0, self.anchor, self.outer_state, self._meta(0, self.anchor))
                self.event("initial_anchor", learner=learner, anchor=self.anchor_sha[:16])
            mine = [[n, list(a.shape), str(a.dtype)]
                    for n, a in zip(self.names, self.anchor, strict=True)]  # fmt: skip
            problem = wire.first_mismatch(mine, describe) or self._other_fragments(fragments)
            if problem:
                raise Refused(f"learner {learner}'s model differs from the syncer's: {problem}")
            old = self.members.get(learner)
            generation = 1 if old is None else old.generation + 1
            self.members[learner] = Member(generation, self.round, self.clock())
            if capacity is not None:
                self.capacity[learner] = float(capacity)
            waits = bool(self.pending) and learner not in self.expected
            self.event("joined", learner=learner, generation=generation,
                       next_round=waits)  # fmt: skip
            if waits:  # the open round goes on without it; it starts from the next anchor
                self._wait_past(self.round, self.timeout + self.grace)
            self._advance()
            self._settle()
            return generation, self.round, self.held()

    def _other_fragments(self, fragments: list[int] | None) -> str:
        """The first leaf ``fragments`` puts in another streaming fragment than the syncer
        does ('' where they agree)."""
        theirs = list(fragments or [0] * len(self.names))
        if len(theirs) != len(self.names):
            return f"fragments of {len(theirs)} leaves, the syncer's of {len(self.names)}"
        for name, mine, other in zip(self.names, self.assignment, theirs, strict=True):
            if mine != other:
                return f"{name} is in streaming fragment {other}, the syncer's {mine}"
        return ""

    def heartbeat(self, learner: int, generation: int) -> int:
        """Marks ``learner`` alive; returns the current round. Raises :class:`Refused` for an
        old generation or a dropped learner (it must join again)."""
        with self.lock:
            member = self._member(learner, generation)
            member.last_seen = self.clock()
            self._advance()
            return self.round

    def leave(self, learner: int, generation: int) -> None:
        with self.lock:
            member = self._member(learner, generation)
            member.status = "left"
            self.event("left", learner=learner, generation=generation)
            self._advance()

    def push(self, learner: int, generation: int, base_round: int, weight: float,
             mean: dict[str, np.ndarray], push_id: str = "", loss: float | None = None,
             whole_finite: bool | None = None) -> int:  # fmt: skip
        """Adds ``learner``'s mean pseudo-gradient against the anchor of ``base_round`` to the
        open round; returns how many rounds late it is (0: on time; the learner's answer is the
        anchor after round ``base_round + late``). ``push_id``: the push's id (a copy of a push
        already in changes nothing; empty: a new id); ``loss``: the learner's mean training
        loss over the round (None: not said); ``whole_finite``: with shards, whether the
        learner's whole mean is finite (this shard sees its own leaves only; None: they are the
        whole). Raises :class:`Refused` (stale, dropped, old generation, wrong leaves, a
        conflict, a loss out of range, leaves not finite in a mean said to be). The network's
        pushes take
        :meth:`admit` and :meth:`enter` themselves, their data streamed to a file between the
        two."""
        described = [[n, list(a.shape), str(a.dtype)] for n, a in mean.items()]
        ticket = self.admit(learner, generation, base_round, push_id or uuid.uuid4().hex,
                            described, weight, loss)  # fmt: skip
        if ticket.kind != "new":
            return 0 if ticket.joined is None else ticket.joined - ticket.base
        try:
            leaves = payload.decode(self._described(base_round), mean, self.codec)
        except wire.WireError as e:
            self.release(ticket)
            raise Refused(str(e)) from None
        finite = all(bool(np.isfinite(x).all()) for x in leaves)
        return self.enter(ticket, weight, leaves, finite, whole_finite)

    def admit(self, learner: int, generation: int, base_round: int, push_id: str,
              leaves: list[list] | None = None, weight: float | None = None,
              loss: float | None = None) -> Ticket:  # fmt: skip
        """The first half of a push, before its data: refuses one that cannot enter the open
        round (stale, dropped, old generation, a conflict, or arrays ``leaves`` ``[[name,
        shape, dtype], ...]`` that do not fit the anchor and codec, or a ``weight`` that is not
        finite or is negative (one above the learner's capacity is capped in :meth:`enter`),
        or a training ``loss`` that is not finite or beyond
        :data:`~.guard.MAX_LOSS`), and recognises a copy of a
        push already in (kind ``"again"``); a new push holds its learner's slot until
        :meth:`enter` or :meth:`release`. Each refusal of a member's push is counted on it."""
        with self.lock:
            self._settle()
            again = self._copy_of(learner, push_id)
            if again is not None:
                return again
            member = self._member(learner, generation, base_round)
            member.last_seen = self.clock()
            if weight is not None:
                self._check_weight(learner, weight)
            self._check_loss(learner, loss)
            if self.finished:  # the run is over: the learner gets the final anchor and ends
                return Ticket("finished", learner, generation, base_round, push_id, base_round)
            self._check_late(learner, base_round)
            taken = self.ledger.slot(learner, generation, base_round, self.pending)
            if taken:
                self._refused(learner, "conflict", base_round=base_round, taken=taken,
                              refused=push_id)  # fmt: skip
                raise Refused(f"conflict: learner {learner} already pushed for round "
                              f"{base_round} (push {taken[:12]}); a different push "
                              f"({push_id[:12]}) for the same slot is refused")  # fmt: skip
            if leaves is not None:
                try:
                    payload.check_leaves(self._described(base_round), leaves, self.codec)
                except wire.WireError as e:
                    self._refused(learner, reason=str(e)[:200])
                    raise Refused(str(e)) from None
            ticket = Ticket("new", learner, generation, base_round, push_id, loss=loss)
            self.ledger.receiving[learner] = ticket
            return ticket

    def _check_weight(self, learner: int, weight: float) -> None:
        """Refuses a push whose weight is no number of examples: NaN, infinite or negative (0
        passes: none of its replicas' pseudo-gradients was finite, and the merge leaves it
        out). A weight above what the learner can train is capped as it enters
        (:meth:`_capped`)."""
        if math.isfinite(weight) and weight >= 0:
            return
        self._refused(learner, reason="weight", weight=str(weight))
        raise Refused(f"a push of learner {learner} refused: its weight {weight} is not a "
                      "finite number >= 0")  # fmt: skip

    def _capped(self, learner: int, weight: float, push_id: str) -> float:
        """``weight``, or the learner's capacity where it declares more (its join's replicas x
        rows per round: more than it can have trained, issue 63), said in a ``capped`` line
        of the tape and counted on its membership."""
        cap = self.capacity.get(learner)
        if cap is None or weight <= cap * (1 + 1e-6):
            return weight
        member = self.members.get(learner)
        if member is not None:
            member.capped += 1
        self.store.taped("capped", self.round, learner=learner, declared=weight, capacity=cap,
                         push=push_id)  # fmt: skip
        log.warning("syncer: learner %d declared a weight of %g, more than it can train in a "
                    "round (%g examples: its replicas x rows per round); capped to %g",
                    learner, weight, cap, cap)  # fmt: skip
        return cap

    def _check_loss(self, learner: int, loss: float | None) -> None:
        """Refuses a push whose training loss (None: not said) is not a finite number within
        :data:`~.guard.MAX_LOSS` of 0: what the status page shows is a number a learner's
        loop can have logged (a learner leaves a loss out rather than send such a one)."""
        if loss is None or (math.isfinite(loss) and abs(loss) <= guard.MAX_LOSS):
            return
        self._refused(learner, reason="loss", loss=str(loss))
        raise Refused(f"a push of learner {learner} refused: its training loss {loss} is not "
                      f"a finite number within {guard.MAX_LOSS:g} of 0")  # fmt: skip

    def _refused(self, learner: int, kind: str = "refused", **fields) -> None:
        """A push of ``learner`` refused: a line in the tape, one more on its membership."""
        member = self.members.get(learner)
        if member is not None:
            member.refused += 1
        self.event(kind, learner=learner, **fields)

    def release(self, ticket: Ticket) -> None:
        """Gives up an admitted push whose data did not arrive whole (its copy may come again)."""
        with self.lock:
            if self.ledger.take(ticket):
                self.lock.notify_all()

    def settled(self, ticket: Ticket, timeout: float, alive=None) -> Ticket | None:
        """A copy's ticket once its first copy is in (``joined`` set), or None when the first
        copy was given up (this one is then pushed as new), or when ``alive()`` (the caller's
        call) turns false."""
        end = self.clock() + timeout
        with self.lock:
            while ticket.joined is None:
                if (ticket.learner not in self.ledger.receiving or self.clock() > end
                        or (alive is not None and not alive())):  # fmt: skip
                    again = self._copy_of(ticket.learner, ticket.id)
                    return again if again is not None and again.joined is not None else None
                self.lock.wait(0.05)
            return ticket

    def enter(self, ticket: Ticket, weight: float, leaves, finite: bool,
              whole_finite: bool | None = None) -> int:  # fmt: skip
        """The second half of a push: its float32 ``leaves`` (a list, or a file:
        :class:`~diloco_jax.learners.intake.Spilled`; ``finite``: whether they all are)
        enter the open round; returns how late it is (a round may have closed while its data
        came, under a quorum). ``whole_finite``: see :meth:`push`."""
        with self.lock:
            self._settle()
            if not self.ledger.take(ticket):
                raise Refused(f"push {ticket.id[:12]} of learner {ticket.learner} was given up")
            self.lock.notify_all()
            learner, generation = ticket.learner, ticket.generation
            if whole_finite is not None:
                if whole_finite and not finite:  # the decision would merge them on this shard
                    self._refused(learner, reason="finite")
                    raise Refused(f"a push of learner {learner} says its mean is finite, but "
                                  "its leaves on this shard are not")  # fmt: skip
                finite = whole_finite  # every shard leaves it out alike
            member = self._member(learner, generation, ticket.base)
            now = member.last_seen = self.clock()
            if self.finished:
                return 0
            late = self._check_late(learner, ticket.base)
            weight = self._capped(learner, float(weight), ticket.id)
            if not finite:
                self.event("not_finite", learner=learner)
            if not self.pending:  # the round opens: it waits for the learners present now
                self._opened, self.deadline = now, now + self.timeout
                self.expected = set(self.present())
                if not self.quorum and self.round == 0:  # a synchronous run starts together:
                    # every declared learner, but those the operator removed
                    self.expected |= set(range(self.learners)) - self.removed
            self.pending[learner] = Push(generation, float(weight), leaves, finite, late,
                                         ticket.id, ticket.base, ticket.loss)  # fmt: skip
            if ticket.loss is not None:
                member.loss = ticket.loss
            if finite:
                self.full_push[learner] = max(self.full_push.get(learner, 0.0), float(weight))
            member.pushes += 1
            member.late += late > 0
            if self._quorum_at is not None:
                self._lags.append(now - self._quorum_at)
            elif self.quorum and sum(not p.late for p in self.pending.values()) >= self.quorum:
                self._quorum_at, self._grace_now = now, self.grace_in_force()
            self.event("pushed", learner=learner, generation=generation, weight=weight,
                       finite=finite, late=late, push=ticket.id, loss=ticket.loss)  # fmt: skip
            self._advance()
            self._settle()
            return late

    def _copy_of(self, learner: int, push_id: str) -> Ticket | None:
        try:
            return self.ledger.copy_of(learner, push_id, self.pending, self.round)
        except PermissionError as e:
            raise Refused(str(e)) from None

    def _check_late(self, learner: int, base_round: int) -> int:
        """How late a push against ``base_round`` is; raises :class:`Refused` for one of a
        round not started, or one too late for the rules."""
        late = self.round - base_round
        if late < 0:
            raise Refused(f"round {base_round} has not started (the syncer is at "
                          f"{self.round})")  # fmt: skip
        if late and (not self.quorum or late > self.max_late):
            rule = (
                "synchronous rounds merge no late work"
                if not self.quorum
                else f"more than syncer.max_late = {self.max_late} rounds behind"
            )
            self._refused(learner, reason="stale", base_round=base_round)
            raise Refused(f"stale: computed against round {base_round}, the syncer is at "
                          f"round {self.round} ({rule}); restart from its anchor")  # fmt: skip
        return late

    def wait(self, after_round: int, timeout: float) -> tuple[int, dict[str, Any]]:
        """Blocks until the syncer is past ``after_round`` (or ``timeout`` seconds, checking the
        round's deadline meanwhile); returns ``(round, anchor by name)``, or with
        ``answer_mean`` ``(round, round after_round's merged mean by name)`` (zeros if it did
        not close, or is older than the syncer remembers)."""
        rnd, named, _, _ = self.reply(after_round, timeout)
        return rnd, named

    def reply(self, after_round: int, timeout: float, holds: int | None = None, alive=None,
              ) -> tuple[int, dict[str, Any], str | None, dict]:  # fmt: skip
        """:meth:`answer`, and the fields that say how to read it. With compress.answers
        (:mod:`.answers`): the anchor's change since round ``holds``, for a learner that holds
        that round's reconstruction, else the reconstruction whole (never the true anchor,
        which only the syncer's outer step goes on from). ``alive``: the waiting call's
        liveness (a call whose learner has gone stops waiting)."""
        if not self.compress_answers:
            return (*self.answer(after_round, timeout, alive), {})
        with self.lock:
            self._wait_past(after_round, timeout, alive)
            self._settle()
            sent = self._sent()
            if sent is None:
                return self.round, {}, None, {}
            return (self.round, *answers.reply(sent, self.names, holds))

    def answer(self, after_round: int, timeout: float,
               alive=None) -> tuple[int, dict[str, Any], str | None]:  # fmt: skip
        """:meth:`wait`'s answer and its SHA-256 where it is the anchor's (None: a mean)."""
        with self.lock:
            self._wait_past(after_round, timeout, alive)
            self._settle()
            leaves: list = self.anchor or []
            if not self.answer_mean:
                return self.round, *self.answered(after_round)  # streaming: a fragment's
            mean = self.means.get(after_round) or [np.zeros(a.shape, a.dtype) for a in leaves]
            leaves = [m.astype(a.dtype) for m, a in zip(mean, leaves, strict=True)]
            return self.round, dict(zip(self.names, leaves, strict=True)), None

    def _wait_past(self, after_round: int, timeout: float, alive=None) -> None:
        end = self.clock() + timeout
        while self.round <= after_round or self._closing:
            left = end - self.clock()
            if left <= 0 or (alive is not None and not alive()):
                break
            self.lock.wait(min(left, 0.05))
            self._advance()

    def decided(self, rnd: int, timeout: float, alive=None) -> Decision | None:
        """How round ``rnd`` closed, on the shard that decides (waiting up to ``timeout`` real
        seconds for it to close, its rules applied meanwhile; ``alive``: the asking call's
        liveness); None when it has not. Raises :class:`Refused` on a shard that does not
        decide, and for a round older than the decisions kept (the last 8, in every
        checkpoint)."""
        if not self.decides:
            raise Refused("this syncer shard does not decide rounds: ask shard 0")
        end = time.monotonic() + timeout
        with self.lock:
            while rnd not in self.decisions and rnd >= self.round and time.monotonic() < end:
                if alive is not None and not alive():
                    break
                self.lock.wait(min(0.05, max(end - time.monotonic(), 0.0)))
                self._advance()
            self._settle()
            if rnd in self.decisions:
                return self.decisions[rnd]
            if rnd < self.round:
                raise Refused(f"round {rnd} closed longer ago than the decisions kept (the "
                              f"last {len(self.decisions)}): this shard is too far behind "
                              f"round {self.round}; start it again from a newer "
                              "checkpoint")  # fmt: skip
            return None

    def follow(self, decision: Decision, timeout: float = 0.0) -> list[int]:
        """Closes the open round as the deciding shard did (a shard that does not decide,
        ``decides=False``: issue 62): its pushes (``decision.learners``, by their ids), merged
        with its weights, lateness, finiteness and full round, the other pushes left for a
        later round. Returns the learners whose pushes this shard has not received (waited
        for up to ``timeout`` seconds; [] once the round is closed, or was before). Raises
        :class:`Refused` for a decision of a round this shard has not reached."""
        if self.decides:
            raise Refused("this shard decides its rounds: it follows no other's")
        with self.lock:
            end = time.monotonic() + timeout  # real seconds, whatever clock the rules run on
            while True:
                self._settle()
                if decision.round < self.round:
                    return []
                if decision.round > self.round:
                    raise Refused(f"a decision of round {decision.round}, but this shard is at "
                                  f"round {self.round}")  # fmt: skip
                missing = [i for i, push_id in zip(decision.learners, decision.ids, strict=True)
                           if i not in self.pending or self.pending[i].id != push_id]  # fmt: skip
                if not missing:
                    self._close("decided", decision)
                    return []
                if time.monotonic() >= end:
                    return missing
                self.lock.wait(min(0.05, end - time.monotonic()))

    def tick(self) -> None:
        """Applies the rules that time alone sets off (a silent learner dropped, a grace window
        or a deadline past), as a waiting learner's call does every 50 ms."""
        with self.lock:
            self._advance()
            self._settle()

    def next_check(self) -> float | None:
        """When, on :attr:`clock`, the open round's grace window or deadline ends (None: no
        round is open)."""
        with self.lock:
            if not self.pending or self._closing:
                return None
            grace_end = None if self._quorum_at is None else self._quorum_at + self._grace_now
            return min(t for t in (self.deadline, grace_end, float("inf")) if t is not None)

    def _member(self, learner: int, generation: int, base_round: int | None = None) -> Member:
        """``learner``'s membership, for a call of its ``generation``; a push (against
        ``base_round``) of a learner dropped for silence under a quorum, at most
        ``syncer.max_late`` rounds late, admits it again (a partition that healed)."""
        if learner in self.removed:
            raise Refused(self._removed_why(learner))
        member = self.members.get(learner)
        if member is None or member.generation != generation:
            raise Refused(f"learner {learner} generation {generation} is not a member (an old "
                          "connection, or never joined): join again")  # fmt: skip
        late = None if base_round is None else self.round - base_round
        if (member.status == "dropped" and self.quorum and late is not None
                and 0 <= late <= self.max_late):  # fmt: skip
            member.status = "present"
            self.event("readmitted", learner=learner, generation=generation, late=late)
        if member.status != "present":
            raise Refused(f"learner {learner} was {member.status}: join again")
        return member

    def _removed_why(self, learner: int) -> str:
        return (f"learner {learner} was removed from the run by its operator (syncer.drop): "
                "its joins and pushes are refused")  # fmt: skip

    def grace_in_force(self) -> float:
        """The grace window a round gets once it has its quorum (see the module's docstring)."""
        if not self.adaptive_grace or not self._history:
            return self.grace
        return min(self.grace, max(0.1 * self.grace, 1.5 * max(self._history)))

    def _advance(self) -> None:
        """Drops silent learners and closes the open round when one of its rules says so (on
        the shard that decides: another closes a round only as its decision says)."""
        if not self.decides:
            return
        now = self.clock()
        for i in self.present():
            m = self.members[i]
            if i not in self.pending and now - m.last_seen > self.dead_after:
                m.status = "dropped"
                self.event("dropped", learner=i, reason=f"silent for {now - m.last_seen:.1f}s")
        if not self.pending or self._closing:
            return
        waiting = [i for i in sorted(self.expected) if i not in self.pending and (
            i not in self.members or self.members[i].status == "present")]  # fmt: skip
        if not waiting:
            self._close("all pushed")
        elif self._quorum_at is not None and now >= self._quorum_at + self._grace_now:
            self._close(f"quorum and {self._grace_now:.2f}s of grace")
        elif self.deadline is not None and now >= self.deadline:
            if not self.quorum:
                for i in (i for i in waiting if i in self.members):  # not those never joined
                    self.members[i].status = "dropped"
                    self.event("dropped", learner=i, reason="no push by the round's deadline")
            self._close("deadline")

    def status(self) -> dict[str, Any]:
        """What the status page and ``/metrics`` show."""
        with self.lock:
            return {
                "round": self.round, "learners": self.learners,
                "mode": f"quorum {self.quorum}" if self.quorum else "sync",
                "quorum": self.quorum, "grace": self.grace, "rounds": self.rounds,
                "examples": self.examples, "merged_examples": self.merged,
                "finished": self.finished,
                "grace_in_force": round(self.grace_in_force(), 3) if self.quorum else 0.0,
                "timeout": self.timeout, "dead_after": self.dead_after,
                "members": {i: dataclasses.asdict(m) for i, m in sorted(self.members.items())},
                "refused": sum(m.refused for m in self.members.values()),
                "pending": sorted(self.pending), "waiting_for": sorted(self.expected - set(
                    self.pending)), "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out, "waited_seconds": round(self.waited, 3),
                "closing": bool(self._closing),
                "merge_rule": getattr(getattr(self.algorithm, "merge", None), "rule", "mean"),
                "removed": sorted(self.removed),
                "suspects": sorted(i for i, m in self.members.items() if m.suspect),
            }  # fmt: skip

    def past_rounds(self) -> list[dict[str, Any]]:
        """The last closed rounds (:attr:`past`) as the status page charts them, oldest first."""
        with self.lock:
            return list(self.past)
