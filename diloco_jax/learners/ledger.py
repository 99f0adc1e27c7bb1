"""Exactly once: the pushes a syncer is receiving and those it merged, by the id a learner
gives each push (its retries carry the same). A copy of a push already in is recognised, and
answered with its round; a different push for a slot already taken (the same learner,
generation and round) is a conflict. The records of merged pushes go into every round's
checkpoint, so a restarted syncer recognises them too; they are kept while a copy could still
be merged (``syncer.max_late`` rounds and one)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from diloco_jax.learners.rounds import Push


@dataclasses.dataclass(frozen=True)
class Merged:
    """What became of a merged push: whose it was, the round it was computed against and the
    round it went into."""

    learner: int
    generation: int
    base: int
    joined: int


class Ticket(NamedTuple):
    """A push admitted by the syncer: ``kind`` ``"new"`` (its data awaited), ``"again"`` (a copy
    of a push already in: answered with ``joined``'s result, or, where that is None, once the
    first copy is in) or ``"finished"`` (the run is over); ``loss``: the learner's training
    loss its header said (None: not said)."""

    kind: str
    learner: int
    generation: int
    base: int
    id: str
    joined: int | None = None
    loss: float | None = None


class Ledger:
    """The syncer's pushes by id: ``receiving`` (admitted, data on the way, by learner) and
    ``records`` (merged, by id)."""

    def __init__(self, records: dict[str, Merged] | None = None):
        self.receiving: dict[int, Ticket] = {}
        self.records: dict[str, Merged] = dict(records or {})

    def copy_of(self, learner: int, push_id: str, pending: dict[int, Push],
                open_round: int) -> Ticket | None:  # fmt: skip
        """A ticket ``"again"`` if ``push_id`` is a push already merged, in the open round
        (``pending``, ``open_round``) or on its way (``joined`` None: not in yet); None if it
        is new. Raises ``PermissionError`` for another learner's id."""
        done = self.records.get(push_id)
        if done is not None:
            if done.learner != learner:
                raise PermissionError(f"push {push_id[:12]} is learner {done.learner}'s")
            return Ticket("again", learner, done.generation, done.base, push_id, done.joined)
        p = pending.get(learner)
        if p is not None and p.id == push_id:
            return Ticket("again", learner, p.generation, p.base, push_id, open_round)
        t = self.receiving.get(learner)
        return t._replace(kind="again") if t is not None and t.id == push_id else None

    def slot(self, learner: int, generation: int, base: int,
             pending: dict[int, Push]) -> str | None:  # fmt: skip
        """The id of a push already in ``learner``'s slot for round ``base`` (open, on its way
        or merged), if any."""
        for held in (pending.get(learner), self.receiving.get(learner)):
            if held is not None:
                return held.id
        return next((k for k, r in self.records.items() if (r.learner, r.generation, r.base)
                     == (learner, generation, base)), None)  # fmt: skip

    def take(self, ticket: Ticket) -> bool:
        """Ends ``ticket``'s reception (its data is in, or given up); False if it was not held."""
        if self.receiving.get(ticket.learner) != ticket:
            return False
        del self.receiving[ticket.learner]
        return True

    def merged(self, pushes: dict[int, Push], closed: int, oldest: int) -> None:
        """Records ``pushes`` (by learner) as merged into round ``closed``; forgets the records
        of rounds before ``oldest`` (a copy of those is refused as stale anyway)."""
        for learner, p in pushes.items():
            self.records[p.id] = Merged(learner, p.generation, p.base, closed)
        self.records = {k: r for k, r in self.records.items() if r.joined >= oldest}

    def to_meta(self) -> dict[str, list]:
        return {k: list(dataclasses.astuple(r)) for k, r in self.records.items()}

    @classmethod
    def from_meta(cls, meta: dict[str, list]) -> Ledger:
        return cls({k: Merged(*v) for k, v in meta.items()})
