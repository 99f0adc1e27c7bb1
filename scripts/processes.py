"""Processes of a benchmark that runs commands and upsets them: finding them, pinning them to
cores, slowing them down, reading their event logs (``scripts/bench_learners.py``)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time


def commands() -> dict[int, str]:
    """Each process's command line, by pid: the launcher's left out, and so is a process
    whose parent has the same command line (a fork on its way to another program, as a run's
    ``git`` call: for a few milliseconds it looks like the run)."""
    lines, parents = {}, {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        pid = int(entry.name)
        lines[pid], parents[pid] = cmdline, int(stat.rsplit(")", 1)[1].split()[1])
    return {pid: c for pid, c in lines.items()
            if "diloco_jax.launch" not in c and lines.get(parents[pid]) != c}  # fmt: skip


def pid_of(*parts: str) -> int | None:
    return next((pid for pid, c in commands().items() if all(p in c for p in parts)), None)


class Spawns:
    """When each learner's processes started (first seen, every 50 ms), and with ``pin``
    learner ``i``'s on core ``i``, pinned as soon as seen, before they start their threads: a
    core per learner, as on machines of their own."""

    def __init__(self, workdir: pathlib.Path, learners: int, pin: bool):
        self.workdir, self.learners, self.pin, self.seen = workdir, learners, pin, set()
        self.cores = sorted(os.sched_getaffinity(0))
        self.times: dict[int, list[float]] = {i: [] for i in range(learners)}

    def look(self) -> None:
        for pid, cmdline in commands().items():
            if pid in self.seen or "diloco_jax.train" not in cmdline:
                continue
            for i in range(self.learners):
                if f"{self.workdir}/learner_{i} " in cmdline + " ":
                    self.seen.add(pid)
                    self.times[i].append(time.time())
                    try:
                        if self.pin:
                            os.sched_setaffinity(pid, {self.cores[i % len(self.cores)]})
                    except OSError:
                        pass


class Throttle:
    """Runs a process at ``speed`` of its pace: SIGSTOP and SIGCONT in turn (0.5 s period).
    ``find()`` gives its pid now (it may change when the process is started again)."""

    def __init__(self, find, speed: float):
        self.find, self.speed, self.done = find, speed, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        period = 0.5
        while not self.done.is_set():
            pid = self.find()
            if pid is None:
                time.sleep(0.1)
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(period * (1 - self.speed))
                os.kill(pid, signal.SIGCONT)
                time.sleep(period * self.speed)
            except ProcessLookupError:
                continue

    def __enter__(self):
        if self.speed < 1:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()
        pid = self.find()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def events(path: pathlib.Path, kind: str) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("event") == kind:
            out.append(e)
    return out
