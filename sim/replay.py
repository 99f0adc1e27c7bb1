"""Learners and a syncer replayed on a virtual clock: a run's wall time and useful work,
predicted from measured times under a failure schedule.

The syncer is the real one (:func:`diloco_jax.learners.command.make_syncer` of the run's
config: its quorum, adaptive grace, late merges, dropping and examples budget), on a virtual
clock and holding a one-number anchor; it writes no checkpoint and never blocks
(:class:`_Virtual`). The learners are timers that follow :mod:`diloco_jax.learners.learner`:

* a learner's process starts ``launch_s`` after the launch (the syncer's start-up), and
  ``startup_s`` later it joins (waiting for the open round to
  close when the syncer says so); ``compile_s`` after its join it takes its first step;
* it takes ``sync_every`` steps of ``step_s / speed`` each and pushes them (weight: the
  steps' examples); the push is in at the syncer ``up_s`` later (its way up the link), and the
  answer reaches the learner ``transfer_s`` after its round closes (the merge, outer step and
  checkpoint, the anchor's way down); a refused push makes it join again, its round's work
  lost;
* synchronous rounds: it waits for the answer and goes on from the new round. Overlapped rounds
  (``outer.mode`` delayed or eager, as :class:`~diloco_jax.learners.learner.Learner` does): it
  goes on at once; at its next sync it waits for the answer of the push before, if that has
  not come yet, and only then sends the next push (one push in flight at a time). Streaming's
  overlap (``streaming.overlap`` tau, a round being one fragment's sync): it takes tau steps
  while the push travels, then waits for the answer if it has not come, then the round's
  other steps;
* a killed learner is down: a new process starts at once (as the launcher starts it again),
  joins, compiles and takes its round's steps again (the work since its last sync is lost);
* it heartbeats every ``heartbeat_s`` while its process lives, so a dead one is dropped by the
  syncer's own rule; the run ends ``tail_s`` after the round that finishes it.

Every party behind a link of its own (:class:`Nics`, as ``scripts/bench_shards.py --link``
serves them): a push no longer takes a fixed ``up_s``; it is a flow through the learner's NIC
and the syncer's (each shard's), and the flows in flight share the syncer's. With ``S`` shards
a learner sends each its part, all at once; the shards are alike (each takes ``share`` of every
push, ``1 / S`` when balanced), so one shard's NIC stands for all: a push's bytes go at
``min(bandwidth, bandwidth / share / n)`` with ``n`` pushes in flight (its own NIC, or its part
of the busiest shard's), then ``latency``, then ``up_s``. An answer is the same flow down,
``transfer_s`` after the round closes (the merge, the outer step, the checkpoint), and a shard
but 0 first hears how the round closed from shard 0 (one more way across two links: twice the
latency).

A slow learner (``speed < 1``) is slow at everything, start-up and compile included. Every
learner has its own cores: a machine whose learners share cores runs faster when one is down
or stopped, which this does not model.
"""

from __future__ import annotations

import heapq
import itertools
import json
import pathlib
import tempfile
from typing import NamedTuple

import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.learners import command
from diloco_jax.learners.syncer import Refused, Syncer

_ANCHOR = {"w": np.zeros(1, np.float32)}
_DESCRIBED = [["w", [1], "float32"]]


class Nics(NamedTuple):
    """Every party behind its own link: a learner's, and each syncer shard's."""

    bandwidth: float  # bytes/s of every party's link, each way
    latency: float  # one way, learner to shard
    up_bytes: int  # a push, its shards' parts together
    down_bytes: int  # an answer, likewise
    shards: int = 1
    share: float | None = None  # the busiest shard's part of a push (None: 1 / shards)
    follow_s: float | None = None  # shard 0 to another, how a round closed (None: 2 x latency)


class Pace(NamedTuple):
    """Measured times of a run's learners, in seconds."""

    step_s: tuple[float, ...]  # one inner step of each learner at full speed
    startup_s: float  # a learner's process start to its join
    compile_s: float  # its join to its first step
    transfer_s: float  # a round's close to its answer at a learner
    tail_s: float  # the last round's close to the run's end
    launch_s: float = 0.0  # the launch to the learners' first processes (the syncer starts)
    restart_startup_s: float | None = None  # the same for a process started again (None: as
    restart_compile_s: float | None = None  # the first; its compile may be from the cache)
    heartbeat_s: float = 0.5
    up_s: float = 0.0  # a push's way up: from its sending to its data in at the syncer
    nics: Nics | None = None  # every party behind a link: each transfer a shared flow

    def startup(self, again: bool) -> float:
        return self.restart_startup_s if again and self.restart_startup_s is not None else (
            self.startup_s)  # fmt: skip

    def compile(self, again: bool) -> float:
        return self.restart_compile_s if again and self.restart_compile_s is not None else (
            self.compile_s)  # fmt: skip


def through_link(pace: Pace, *, bandwidth: float | None, latency: float, up_bytes: int,
                 down_bytes: int) -> Pace:  # fmt: skip
    """``pace`` (measured without a link: on loopback) for learners each behind a link of
    ``bandwidth`` bytes/s (None: no limit) and one-way ``latency`` seconds
    (:class:`sim.link.Link`'s model: ``B`` bytes sent at once arrive ``B / bandwidth +
    latency`` later), pushing ``up_bytes`` and answered with ``down_bytes`` (their values; the
    framing is under 1%): the push's way up and the answer's way down added."""

    def way(n: int) -> float:
        return n / bandwidth + latency if bandwidth else latency

    return pace._replace(up_s=pace.up_s + way(up_bytes), transfer_s=pace.transfer_s + way(
        down_bytes))  # fmt: skip


class Replayed(NamedTuple):
    wall_s: float
    useful_steps: float  # replica-steps whose pseudo-gradient reached the anchor
    rounds: int
    kills: int
    late_pushes: int
    tape: list  # the syncer's events, on the virtual clock
    waited: dict  # each learner's wait from a push to its answer, push by push


class _Virtual(Syncer):
    """The syncer's rules on a virtual clock: no checkpoint, and a join that would wait for the
    open round returns at once (the replay makes the learner wait in virtual time)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.tape: list[dict] = []

    def event(self, kind: str, **fields) -> None:
        self.tape.append({"event": kind, "round": self.round, "time": self.clock(), **fields})

    background = False  # rounds close inline, on the virtual clock

    def _save(self, *args) -> None:
        pass

    def _wait_past(self, after_round: int, timeout: float) -> None:
        pass


class _Shared:
    """One shard's link in one direction: the flows in flight share ``capacity`` bytes/s
    equally, none faster than ``cap`` (its learner's own NIC); a flow's bytes count the whole
    push or answer (every shard's part: so ``capacity`` is a shard's bandwidth over its share)."""

    def __init__(self, capacity: float, cap: float):
        self.capacity, self.cap = capacity, cap
        self.flows: dict[tuple, float] = {}  # (learner, epoch, what) -> bytes left
        self.t, self.version = 0.0, 0

    def rate(self) -> float:
        return min(self.cap, self.capacity / len(self.flows)) if self.flows else 0.0

    def advance(self, now: float) -> None:
        gone = self.rate() * (now - self.t)
        self.flows = {k: left - gone for k, left in self.flows.items()}
        self.t = now

    def add(self, now: float, key: tuple, nbytes: float) -> None:
        self.advance(now)
        self.flows[key] = float(nbytes)
        self.version += 1

    def drop(self, now: float, learner: int) -> None:
        self.advance(now)
        self.flows = {k: v for k, v in self.flows.items() if k[0] != learner}
        self.version += 1

    def next_done(self) -> float | None:
        return self.t + min(self.flows.values()) / self.rate() if self.flows else None

    def done(self, now: float) -> list[tuple]:
        self.advance(now)
        slack = 1e-6 + self.rate() * 1e-9  # a nanosecond's bytes: the float sums' rounding
        out = [k for k, left in self.flows.items() if left <= slack]
        for k in out:
            del self.flows[k]
        self.version += 1
        return out


class _Learner:
    def __init__(self, speed: float):
        self.speed, self.generation, self.epoch = speed, 0, 0  # epoch: its process, from 1
        self.base = 0  # the round its work is against
        self.pushed_at = 0.0  # when it last pushed
        self.waits_for: int | None = None  # answered when the syncer is past this round
        self.joining = False  # its answer is a join's: it compiles before it steps
        self.in_flight = False  # overlapped: a push sent whose answer has not come
        self.blocked_at: float | None = None  # overlapped: at a sync, waiting for that answer


class _Replay:
    def __init__(self, cfg: config_lib.Config, pace: Pace, speeds, kill: tuple[int, int] | None,
                 workdir: pathlib.Path):  # fmt: skip
        self.now = 0.0
        self.syncer = command.make_syncer(cfg, workdir, cls=_Virtual, clock=lambda: self.now)
        self.pace, self.kill = pace, kill
        self.overlap = cfg.outer.mode in ("delayed", "eager")
        self.tau = cfg.streaming.overlap  # streaming: steps trained while a push travels
        self.H, self.rows = cfg.outer.sync_every, cfg.data.batch_size * cfg.parallel.replicas
        self.learners = [_Learner(float(s)) for s in speeds]
        self.queue: list = []
        self.order = itertools.count()
        self.kills, self.seen_round, self.end = 0, 0, None
        self.tick_at: float | None = None
        self.waited: dict[int, list[float]] = {i: [] for i in range(len(speeds))}
        self.nics = pace.nics
        self.links: dict[str, _Shared] = {}
        if self.nics is not None:
            share = self.nics.share or 1.0 / self.nics.shards
            self.links = {way: _Shared(self.nics.bandwidth / share, self.nics.bandwidth)
                          for way in ("up", "down")}  # fmt: skip

    def at(self, t: float, kind: str | tuple, i: int = -1) -> None:
        epoch = self.learners[i].epoch if i >= 0 else 0
        heapq.heappush(self.queue, (t, next(self.order), kind, i, epoch))

    def start(self, i: int) -> None:  # a new process
        me = self.learners[i]
        me.epoch += 1
        for link in self.links.values():  # the old process's connections are gone
            if any(k[0] == i for k in link.flows):
                link.drop(self.now, i)
                self.schedule(link)
        self.at(self.now + self.pace.startup(me.epoch > 1) / me.speed, "join", i)
        self.at(self.now, "beat", i)

    def join(self, i: int, compile_first: bool) -> None:
        me = self.learners[i]
        keys = self.syncer.keys
        me.generation, me.base, _ = self.syncer.join(i, _DESCRIBED, keys, _ANCHOR)
        if self.syncer.tape[-1].get("next_round", False):  # it goes on from the next round
            me.waits_for, me.joining = me.base, compile_first
        else:
            self.go_on(i, self.now, compile_first)

    def schedule(self, link: _Shared) -> None:
        done = link.next_done()
        if done is not None:
            way = "up" if link is self.links.get("up") else "down"
            self.at(done, ("flow", way, link.version))

    def send(self, way: str, i: int, what: str) -> None:
        """Learner ``i``'s push (``way`` up), or its answer (down; ``what``: "answer", or
        "joined" for a join's anchor) once the round's merge, outer step and checkpoint are
        done: after the pace's fixed times, or through the links."""
        if self.nics is None:
            if way == "up":
                return self.at(self.now + self.pace.up_s, "arrive", i)
            return self.at(self.now + self.pace.transfer_s, what, i)
        if way == "down" and self.pace.transfer_s > 0:
            return self.at(self.now + self.pace.transfer_s, ("send", what), i)
        self.flow(way, i, what)

    def flow(self, way: str, i: int, what: str) -> None:
        link = self.links[way]
        assert self.nics is not None
        link.add(self.now, (i, self.learners[i].epoch, what), self.nics.up_bytes if way == "up"
                 else self.nics.down_bytes)  # fmt: skip
        self.schedule(link)

    def flowed(self, way: str, version: int) -> None:
        link = self.links[way]
        if version != link.version:
            return  # the flows changed since: a later event stands
        assert self.nics is not None
        for i, epoch, what in link.done(self.now):
            if epoch != self.learners[i].epoch:
                continue
            if way == "up":
                self.at(self.now + self.nics.latency + self.pace.up_s, "arrive", i)
            else:
                follow = self.nics.follow_s
                if follow is None:
                    follow = 2 * self.nics.latency
                follow = follow if self.nics.shards > 1 else 0.0
                self.at(self.now + self.nics.latency + follow, what, i)
        self.schedule(link)

    def joined(self, i: int) -> None:
        """A join that waited for the open round: its anchor is in; it compiles, then steps."""
        self.go_on(i, self.now, True)

    def go_on(self, i: int, t: float, compile_first: bool, steps: int | None = None) -> None:
        """Learner ``i`` takes ``steps`` (a round's by default) from ``t``, then pushes."""
        me = self.learners[i]
        compile_s = self.pace.compile(me.epoch > 1) if compile_first else 0.0
        work = (self.H if steps is None else steps) * self.pace.step_s[i] + compile_s
        self.at(t + work / me.speed, "push", i)

    def push(self, i: int) -> None:
        """Learner ``i`` at a sync: it sends its push (overlapped: and goes on), or, overlapped
        with the answer of the push before not in yet, waits for it."""
        me = self.learners[i]
        if self.overlap and me.in_flight:
            me.blocked_at = self.now
            return
        if self.overlap:  # the next push is for the round after this one
            me.in_flight = True
            self.go_on(i, self.now, False)
        me.pushed_at = self.now
        self.send("up", i, "push")
        if self.tau:  # streaming's overlap: tau steps while the push travels, then its answer
            me.in_flight = True
            self.at(self.now + self.tau * self.pace.step_s[i] / me.speed, "need", i)

    def need(self, i: int) -> None:
        """Streaming's overlap: learner ``i``, tau steps after its push, needs the answer: it
        takes the round's other steps once the answer is in (waiting for it if not yet)."""
        me = self.learners[i]
        if me.in_flight:
            me.blocked_at = self.now
            return
        self.waited[i].append(0.0)
        self.go_on(i, self.now, False, self.H - self.tau)

    def arrive(self, i: int) -> None:
        """Learner ``i``'s push in at the syncer."""
        me = self.learners[i]
        try:
            late = self.syncer.push(i, me.generation, me.base, self.H * self.rows, _ANCHOR)
        except Refused:
            return self.join(i, compile_first=False)
        me.waits_for = me.base + late
        if self.overlap:
            me.base += 1

    def answer(self, i: int) -> None:
        """The answer of learner ``i``'s push reaches it."""
        me = self.learners[i]
        if self.tau:
            me.in_flight = False
            if me.blocked_at is not None:  # it waited, tau steps after its push
                self.waited[i].append(self.now - me.blocked_at)
                me.blocked_at = None
                self.go_on(i, self.now, False, self.H - self.tau)
            return
        if not self.overlap:
            self.waited[i].append(self.now - me.pushed_at)
            self.go_on(i, self.now, False)
            return
        me.base, me.in_flight = max(me.base, self.syncer.round), False
        if me.blocked_at is not None:  # it waited at its sync: it pushes now
            self.waited[i].append(self.now - me.blocked_at)
            me.blocked_at = None
            self.push(i)
        else:
            self.waited[i].append(0.0)

    def answers(self) -> None:
        """After any call: the learners a closed round answers, a kill it sets off, the end."""
        sy = self.syncer
        if sy.round > self.seen_round:
            self.seen_round = sy.round
            if sy.finished and self.end is None:
                self.end = self.now + self.pace.tail_s
            for i, me in enumerate(self.learners):
                if me.waits_for is not None and sy.round > me.waits_for:
                    me.waits_for = None
                    if sy.finished:
                        continue
                    if me.joining:  # a join that waited for the open round: it compiles
                        me.base, me.joining = sy.round, False
                        self.send("down", i, "joined")
                        continue
                    if not self.overlap:
                        me.base = sy.round
                    self.send("down", i, "answer")
            if self.kill and not sy.finished and sy.round >= (self.kills + 1) * self.kill[1]:
                self.kills += 1
                killed = self.learners[self.kill[0]]
                killed.waits_for, killed.generation, killed.joining = None, 0, False
                killed.blocked_at, killed.in_flight = None, False
                self.start(self.kill[0])  # the old process's events are dropped by epoch
        check = sy.next_check()
        if check is not None and check != self.tick_at:
            self.tick_at = check
            self.at(max(check, self.now), "tick")

    def run(self, limit_s: float) -> Replayed:
        self.now = self.pace.launch_s
        for i in range(len(self.learners)):
            self.start(i)
        while self.queue and self.end is None and self.now < limit_s:
            self.now, _, kind, i, epoch = heapq.heappop(self.queue)
            if i >= 0 and epoch != self.learners[i].epoch:
                continue  # an event of a killed process
            if kind == "join":
                self.join(i, compile_first=True)
            elif kind == "push":
                self.push(i)
            elif kind == "arrive":
                self.arrive(i)
            elif kind == "answer":
                self.answer(i)
            elif kind == "joined":
                self.joined(i)
            elif isinstance(kind, tuple) and kind[0] == "flow":
                self.flowed(kind[1], kind[2])
            elif isinstance(kind, tuple):  # ("send", what): an answer's flow starts now
                self.flow("down", i, kind[1])
            elif kind == "need":
                self.need(i)
            elif kind == "beat":
                me = self.learners[i]
                try:
                    if me.generation:
                        self.syncer.heartbeat(i, me.generation)
                except Refused:
                    pass  # its next push is refused and it joins again
                self.at(self.now + self.pace.heartbeat_s, "beat", i)
            else:
                self.syncer.tick()
            self.answers()
        if self.end is None:
            raise RuntimeError(f"the replay did not finish within {limit_s:.0f} virtual seconds")
        closed = [e for e in self.syncer.tape if e["event"] == "closed"]
        return Replayed(
            wall_s=self.end,
            useful_steps=sum(w / self.rows for e in closed for w in e["weights"]),
            rounds=len(closed),
            kills=self.kills,
            late_pushes=sum(len(e["late"]) for e in closed),
            tape=self.syncer.tape,
            waited=self.waited,
        )


def replay(cfg: config_lib.Config, pace: Pace, speeds=None, kill: tuple[int, int] | None = None,
           limit_s: float = 1e6) -> Replayed:  # fmt: skip
    """The run of ``cfg``'s learners (``syncer.learners`` of them, at ``speeds``, each 1 by
    default) at ``pace``; ``kill = (learner, every)``: that learner is killed whenever the
    syncer has closed another ``every`` rounds, as ``scripts/bench_learners.py`` does."""
    speeds = np.ones(cfg.syncer.learners) if speeds is None else np.asarray(speeds, float)
    if len(speeds) != cfg.syncer.learners or len(pace.step_s) != cfg.syncer.learners:
        raise ValueError(f"speeds and step times for {cfg.syncer.learners} learners "
                         "(syncer.learners)")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="replay_") as tmp:
        return _Replay(cfg, pace, speeds, kill, pathlib.Path(tmp)).run(limit_s)


def _lines(path: pathlib.Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def measure(workdir: pathlib.Path, started: float, wall_s: float,
            spawned: dict | None = None) -> Pace:  # fmt: skip
    """The :class:`Pace` of a finished learners' run without failures (``diloco-launch
    --learners``'s ``--workdir``; ``started``: its launch, on ``time.time()``; ``wall_s``: launch
    to end; ``spawned``: each learner's process start, else the launch), from the syncer's tape
    and each learner's ``round`` events: a learner's step is its time from one push to the next
    less its wait, over ``sync_every``; ``transfer_s`` is the last pusher's wait in a round;
    medians over rounds and learners."""
    cfg = json.loads((workdir / "learner_0" / "config.json").read_text())
    H = cfg["outer"]["sync_every"]
    tape = _lines(workdir / "syncer" / "syncer.jsonl")
    learners = sorted({e["learner"] for e in tape if e["event"] == "joined"})
    joined = {i: min(e["time"] for e in tape if e["event"] == "joined" and e["learner"] == i)
              for i in learners}  # fmt: skip
    pushed = {i: [e["time"] for e in tape if e["event"] == "pushed" and e["learner"] == i]
              for i in learners}  # fmt: skip
    waited = {i: [e["seconds_waited"] for e in _lines(workdir / f"learner_{i}" / "metrics.jsonl")
                  if e["event"] == "round"] for i in learners}  # fmt: skip
    step_s = []
    for i in learners:
        p, w = pushed[i], waited[i]
        step_s.append(float(np.median([(p[k + 1] - p[k] - w[k]) / H for k in range(len(p) - 1)])))
    closes = [e["time"] for e in tape if e["event"] == "closed"]
    last_waits = []
    for k in range(len(closes)):
        last = max(learners, key=lambda i: pushed[i][k] if k < len(pushed[i]) else -1.0)
        if k < len(waited[last]):  # the run's last answer may have no event
            last_waits.append(waited[last][k])
    spawns = {int(k): v for k, v in (spawned or {}).items()}  # JSON keys are strings
    first = {i: spawns.get(i, [started])[0] for i in learners}
    compiles = [pushed[i][0] - joined[i] - H * s for i, s in zip(learners, step_s, strict=True)]
    return Pace(
        step_s=tuple(step_s),
        startup_s=float(np.median([joined[i] - first[i] for i in learners])),
        compile_s=float(np.median(compiles)),
        transfer_s=float(np.median(last_waits)),
        tail_s=started + wall_s - closes[-1],
        launch_s=float(np.median([first[i] - started for i in learners])),
    )


def measure_restarts(workdir: pathlib.Path, spawned: dict, pace: Pace) -> Pace:
    """``pace`` with the times of learners started again, from a run where they were
    (``spawned``: each learner's process starts, on ``time.time()``): a new process's start to
    its join, and its join (or, when the join waited, the answer of the round it waited for) to
    its first push, less that push's steps; medians over the new processes that pushed."""
    H = json.loads((workdir / "learner_0" / "config.json").read_text())["outer"]["sync_every"]
    tape = _lines(workdir / "syncer" / "syncer.jsonl")
    startups, compiles = [], []
    for i, times in ((int(k), v) for k, v in spawned.items()):
        for start, after in zip(times[1:], [*times[2:], float("inf")], strict=False):
            joins = [e for e in tape if e["event"] == "joined" and e["learner"] == i
                     and start < e["time"] < after]  # fmt: skip
            if not joins:
                continue  # killed before it joined
            join = joins[0]
            startups.append(join["time"] - start)
            ready = join["time"]
            if join.get("next_round"):
                closes = [e["time"] for e in tape if e["event"] == "closed" and e["time"] >= ready]
                ready = closes[0] + pace.transfer_s if closes else ready
            pushes = [e["time"] for e in tape if e["event"] == "pushed" and e["learner"] == i
                      and e["generation"] == join["generation"]]  # fmt: skip
            if pushes:
                compiles.append(pushes[0] - ready - H * pace.step_s[i])
    if not startups:
        return pace
    return pace._replace(
        restart_startup_s=float(np.median(startups)),
        restart_compile_s=float(np.median(compiles)) if compiles else None,
    )
