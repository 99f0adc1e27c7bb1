"""What keeps one caller of the syncer from taking more than its share: the calls it may have in
flight (:class:`Lanes`), how long a call may go without a message (:class:`Watchdog`), and the
fields of a request checked before anything else is read (:func:`push_fields`,
:func:`push_loss`, :func:`join_fields`).

gRPC's synchronous server gives each call a worker thread for as long as its handler runs, so a
caller that opens calls and never finishes them would hold every worker (a learner whose
heartbeat then waits is dropped). Here a caller is its identity, proved by its credential before
a worker does anything else: each learner has at most :data:`LANES` calls of each method at
once (a heartbeat has a lane of its own, so a learner's push never delays its heartbeat), and a
call whose caller sends or reads nothing for :data:`IDLE` seconds is cancelled, whatever its
deadline. A wrong credential is refused at once (:class:`~.identity.Failures`), holding no lane.
The server's pool has a worker for every lane of every learner, and more for the refusals.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

# a retry may overlap its first try; Decision: a following syncer shard's (issue 62)
LANES = {"Join": 2, "Push": 2, "Heartbeat": 1, "Leave": 1, "Decision": 1}
IDLE = 60.0  # seconds a call may go without a message either way (not while it waits a round)
SPARE_WORKERS = 16  # workers beyond the lanes: for refusals, which hold one for microseconds
PUSH_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
MAX_INDEX = 1 << 40  # rounds, generations: far beyond any run, far below float64's integers
# a push's training loss, in absolute value (beyond: a learner leaves it out, the syncer refuses)
MAX_LOSS = 1e12


class Lanes:
    """Calls in flight per ``(identity, method)``, at most :data:`LANES` of a method."""

    def __init__(self, limits: dict[str, int] | None = None):
        self.limits = dict(LANES if limits is None else limits)
        self.busy: dict[tuple, int] = {}
        self.lock = threading.Lock()

    def enter(self, who: Any, method: str) -> bool:
        """Takes a lane of ``method`` for ``who``; False when all of them are taken."""
        with self.lock:
            n = self.busy.get((who, method), 0)
            if n >= self.limits[method]:
                return False
            self.busy[(who, method)] = n + 1
            return True

    def leave(self, who: Any, method: str) -> None:
        with self.lock:
            n = self.busy.get((who, method), 0) - 1
            if n > 0:
                self.busy[(who, method)] = n
            else:
                self.busy.pop((who, method), None)

    def workers(self, learners: int, shards: int = 1) -> int:
        """The server's pool: a worker for every lane of ``learners`` learners and of the
        ``shards`` - 1 syncer shards that follow this one, and spares."""
        each = sum(n for method, n in self.limits.items() if method != "Decision")
        return SPARE_WORKERS + learners * each + (shards - 1) * self.limits.get("Decision", 0)


class Watched:
    """One call under the watchdog: :meth:`touch` at each message, :meth:`waiting` around a
    wait for the syncer (not idle time), :meth:`done` at its end."""

    def __init__(self, cancel: Callable[[], None], clock: Callable[[], float]):
        self.cancel, self.clock = cancel, clock
        self.last = clock()
        self.waits = 0
        self.over = False

    def touch(self) -> None:
        self.last = self.clock()

    def idle(self) -> float:
        return 0.0 if self.waits else self.clock() - self.last

    def waiting(self) -> _Waiting:
        return _Waiting(self)

    def requests(self, requests) -> Iterator[bytes]:
        """The call's messages, each one touching it."""
        for message in requests:
            self.touch()
            yield message

    def replies(self, chunks) -> Iterator[bytes]:
        """The answer's messages, each one touching it as it is taken to be sent."""
        for chunk in chunks:
            self.touch()
            yield chunk

    def done(self) -> None:
        self.over = True


class _Waiting:
    def __init__(self, watched: Watched):
        self.watched = watched

    def __enter__(self) -> None:
        self.watched.waits += 1

    def __exit__(self, *_) -> None:
        self.watched.waits -= 1
        self.watched.touch()


class Watchdog:
    """Cancels calls idle for more than ``idle`` seconds, checking every ``every`` seconds in a
    thread of its own (started at the first call)."""

    def __init__(self, idle: float = IDLE, every: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.limit, self.every, self.clock = idle, every, clock
        self.calls: set[Watched] = set()
        self.lock = threading.Lock()
        self.cancelled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, cancel: Callable[[], None]) -> Watched:
        watched = Watched(cancel, self.clock)
        with self.lock:
            self.calls.add(watched)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
                self._thread.start()
        return watched

    def forget(self, watched: Watched) -> None:
        watched.done()
        with self.lock:
            self.calls.discard(watched)

    def check(self) -> int:
        """Cancels the calls idle too long now; returns how many."""
        with self.lock:
            idle = [w for w in self.calls if w.idle() > self.limit]
            for w in idle:
                self.calls.discard(w)
            self.cancelled += len(idle)  # counted before the cancel reaches anyone
        for w in idle:
            w.cancel()
        return len(idle)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.check()

    def stop(self) -> None:
        self._stop.set()


class BadField(ValueError):
    """A request field that is missing or out of range (the message names it)."""


def integer(fields: dict, name: str, low: int = 0, high: int = MAX_INDEX) -> int:
    """``fields[name]`` as an integer in ``[low, high]`` (a JSON integer, not a float or a
    string); raises :class:`BadField`."""
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadField(f"{name} must be an integer, not {_shown(value)}")
    if not low <= value <= high:
        raise BadField(f"{name} = {value} is not in [{low}, {high}]")
    return value


def push_fields(fields: dict) -> tuple[int, int, float, str, int | None]:
    """A push's ``(generation, round, weight, push id, holds)`` from its header, each checked:
    integers in range, the weight a finite number >= 0 (the examples it trained on: 0 when
    none of its replicas' pseudo-gradients was finite), the id of at most 64 characters of
    ``[0-9A-Za-z_-]``. Raises :class:`BadField`. Whether the weight is more than the learner
    could have trained is the syncer's rule (:meth:`~.syncer.Syncer.admit`)."""
    generation, base = integer(fields, "generation"), integer(fields, "round")
    weight = fields.get("weight")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise BadField(f"weight must be a number, not {_shown(weight)}")
    if not math.isfinite(weight) or weight < 0:
        raise BadField(f"weight = {weight} is not a finite number >= 0")
    push_id = fields.get("push")
    if not isinstance(push_id, str) or not PUSH_ID.fullmatch(push_id):
        raise BadField(f"push id {_shown(push_id)} is not 1-64 characters of [0-9A-Za-z_-]")
    holds = None if fields.get("holds") is None else integer(fields, "holds", -1)
    return generation, base, float(weight), push_id, holds


def push_finite(fields: dict) -> bool | None:
    """Whether a push to a syncer shard says its learner's whole mean is finite (None: not
    said, as a push to a single syncer, which sees every leaf): a boolean, or
    :class:`BadField`."""
    finite = fields.get("finite")
    if finite is None or isinstance(finite, bool):
        return finite
    raise BadField(f"finite must be true or false, not {_shown(finite)}")


def push_loss(fields: dict) -> float | None:
    """A push's training loss from its header (the learner's mean over the round; None where
    it says none): a number, or :class:`BadField`. Whether it is finite and within
    :data:`MAX_LOSS` is the syncer's rule, which counts the refusal on the learner
    (:meth:`~.syncer.Syncer.admit`)."""
    loss = fields.get("loss")
    if loss is None:
        return None
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        raise BadField(f"loss must be a number, not {_shown(loss)}")
    try:
        return float(loss)
    except OverflowError:  # a JSON integer of hundreds of digits: refused as out of range
        return math.inf


def join_fields(fields: dict) -> tuple[list, dict, list[int] | None, float | None]:
    """A join's ``(described leaves, training keys, fragments, capacity)``, each checked for
    its shape (a list of ``[name, shape, dtype]``, a dict, a list of integers); ``capacity``:
    the examples the learner can train in a round (its ``replicas`` x ``rows``), None where
    the join does not say. Raises :class:`BadField`."""
    described = fields.get("describe")
    if not isinstance(described, list) or not all(_leaf(d) for d in described):
        raise BadField("describe must be a list of [name, shape, dtype]")
    keys = fields.get("keys")
    if not isinstance(keys, dict):
        raise BadField("keys must be a mapping of the training keys")
    fragments = fields.get("fragments")
    if fragments is not None and not (isinstance(fragments, list) and all(
            isinstance(f, int) and not isinstance(f, bool) and 0 <= f < 1 << 16
            for f in fragments)):  # fmt: skip
        raise BadField("fragments must be a list of fragment indices")
    capacity = None
    if "replicas" in fields or "rows" in fields:
        capacity = float(integer(fields, "replicas", 1, 1 << 20) * integer(fields, "rows", 1))
    return described, keys, fragments, capacity


def _leaf(d: Any) -> bool:
    return (isinstance(d, list) and len(d) == 3 and isinstance(d[0], str) and len(d[0]) <= 4096
            and isinstance(d[1], list) and len(d[1]) <= 64 and isinstance(d[2], str)
            and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 40
                    for n in d[1]))  # fmt: skip


def _shown(value: Any) -> str:
    """A caller's value as an error message may show it: short, escaped."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
