"""Chaos on localhost (issue 41): learners and a syncer as real processes, killed, restarted,
joined late and slowed down. Slow (a minute or more each on 2 cores); their stand-ins in the
default suite are tests/test_learners.py's test-clock tests (a learner dropped and rejoining,
quorum rounds with a late push, a joiner taking the next round) and its syncer restarted in
one process."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import helpers

pytestmark = pytest.mark.slow  # 2-3 min in all; stand-ins: the docstring above
ROOT = pathlib.Path(__file__).resolve().parents[1]
TOKEN = "chaos-test-token"
RUN = ["--config", "tiny", "--config.parallel.replicas=1", "--config.train.total_steps=40",
       "--config.outer.sync_every=5", "--config.train.log_every=5",
       "--config.train.checkpoint_every=5", "--config.train.sample_chars=0",
       "--config.log.figures=false", "--config.syncer.heartbeat=0.5",
       "--config.syncer.dead_after=30", "--config.syncer.timeout=90"]  # fmt: skip


def _env():
    return helpers.child_env(DILOCO_SERVE_TOKEN=TOKEN, TQDM_DISABLE="1")


def _launch(workdir: pathlib.Path, learners: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "diloco_jax.launch", "--learners", str(learners),
               "--max_restarts", "2", "--", *RUN, "--workdir", str(workdir), *extra]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _tape(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "syncer" / "syncer.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _closed(workdir: pathlib.Path) -> list[dict]:
    return [e for e in _tape(workdir) if e["event"] == "closed"]


def _wait_until(what, seconds: float = 240.0) -> None:
    end = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < end, "timed out waiting for the run"
        time.sleep(0.1)


def _pid(*parts: str) -> int:
    """The process whose command line holds every one of ``parts``."""
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if all(p in cmdline for p in parts) and "diloco_jax.launch" not in cmdline:
            return int(entry.name)
    raise AssertionError(f"no process with {parts}")


def _finish(proc: subprocess.Popen, seconds: float = 300.0) -> str:
    try:
        out, _ = proc.communicate(timeout=seconds)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return out


def _done(workdir: pathlib.Path) -> bool:
    path = workdir / "metrics.jsonl"
    return path.is_file() and '"event": "done"' in path.read_text()


def _final_losses(workdir: pathlib.Path, learners: int) -> list[float]:
    return [helpers.events(workdir / f"learner_{i}", "done")[-1]["final_eval_loss"]
            for i in range(learners)]  # fmt: skip


def test_a_syncer_killed_mid_run_and_restarted_changes_nothing(tmp_path):
    """Two learners through ``diloco-launch --learners 2``; the syncer is SIGKILLed after round
    2 closes (the learners' calls fail meanwhile and are retried) and the launcher starts it
    again from its checkpoint. Every round closes with both learners and the final anchor and
    eval losses equal those of the same run without the kill, bit for bit."""
    reference = tmp_path / "reference"
    _finish(_launch(reference, 2))
    chaos = tmp_path / "chaos"
    proc = _launch(chaos, 2)
    _wait_until(lambda: len(_closed(chaos)) >= 2)
    os.kill(_pid("diloco_jax.syncer", str(chaos)), signal.SIGKILL)
    out = _finish(proc)
    assert "the syncer exited with status -9; starting it again" in out
    tape = _tape(chaos)
    assert any(e["event"] == "restored" for e in tape)
    closed, want = _closed(chaos), _closed(reference)
    assert [e["closed"] for e in closed] == list(range(8))
    assert all(e["learners"] == [0, 1] for e in closed)
    assert [e["anchor"] for e in closed] == [e["anchor"] for e in want]
    assert _final_losses(chaos, 2) == _final_losses(reference, 2)


def test_a_learner_killed_mid_round_is_restarted_and_rejoins(tmp_path):
    """Learner 1 is SIGKILLed mid-round (after round 2 closes, while it trains the next);
    learner 0 waits in its round, the launcher starts learner 1 again, it resumes from its own
    checkpoint at step S, joins with a new generation and the round closes with both. From its
    resume it pushes once per round for its remaining (40 - S) / 5 rounds; every round closed
    while learner 0 was there has both learners, and the rounds learner 1 redoes after learner
    0 finished have it alone. Nothing is dropped or refused."""
    import re

    workdir = tmp_path / "run"
    proc = _launch(workdir, 2)
    _wait_until(lambda: len(_closed(workdir)) >= 2)
    os.kill(_pid("diloco_jax.train", str(workdir / "learner_1")), signal.SIGKILL)
    out = _finish(proc)
    assert "learner 1 exited with status -9; starting it again" in out
    resumed = re.search(r"resumed from \S*learner_1\S* at step (\d+)", out)
    tape = _tape(workdir)
    joins = [e for e in tape if e["event"] == "joined" and e["learner"] == 1]
    assert [e["generation"] for e in joins] == [1, 2]
    again = sum(e["event"] == "pushed" and e["learner"] == 1 and e["generation"] == 2
                for e in tape)  # fmt: skip
    assert again == (40 - (int(resumed.group(1)) if resumed else 0)) // 5
    left = next(e["round"] for e in tape if e["event"] == "left" and e["learner"] == 0)
    closed = _closed(workdir)
    assert [e["learners"] for e in closed] == [[0, 1]] * left + [[1]] * (len(closed) - left)
    assert len(closed) >= 8
    assert not [e for e in tape if e["event"] in ("dropped", "refused")]


def _start(workdir: pathlib.Path, module: str, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", module, *RUN, "--workdir", str(workdir), *extra]
    return subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def test_a_new_learner_joins_at_a_later_round_and_the_others_go_on(tmp_path):
    """Three learners declared, two started; round 0 waits for the third until its deadline
    (10 s), then closes without it. Learner 2 starts once round 2 has closed (160 steps
    each: 32 rounds, so the first two are still training when it has started). It joins
    at the next round without holding up the open one; the rounds before it closed with learners
    0 and 1, later ones with all three."""
    from diloco_jax.launch import free_port

    port = free_port()
    address = [f"--config.syncer.address=127.0.0.1:{port}", "--config.syncer.learners=3",
               "--config.train.total_steps=160", "--config.syncer.timeout=10"]  # fmt: skip
    syncer = _start(tmp_path / "syncer", "diloco_jax.syncer", *address)
    procs = []
    try:
        procs = [_start(tmp_path / f"learner_{i}", "diloco_jax.train", *address,
                        f"--config.syncer.learner={i}") for i in (0, 1)]  # fmt: skip
        _wait_until(lambda: len(_closed(tmp_path)) >= 2)
        procs.append(_start(tmp_path / "learner_2", "diloco_jax.train", *address,
                            "--config.syncer.learner=2"))  # fmt: skip
        for p in procs:
            _finish(p)
    finally:
        for p in [syncer, *procs]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        syncer.wait(30)
    tape = _tape(tmp_path)
    join = next(e for e in tape if e["event"] == "joined" and e["learner"] == 2)
    closed = _closed(tmp_path)
    before = [e for e in closed if e["closed"] < join["round"]]
    assert len(before) >= 2 and all(e["learners"] == [0, 1] for e in before)
    assert any(e["learners"] == [0, 1, 2] for e in closed)
    assert not [e for e in tape if e["event"] in ("dropped", "refused")]


def test_under_a_quorum_a_slow_learner_does_not_slow_the_others(tmp_path):
    """Three learners of 160 steps, quorum 2, a fixed grace of 0.05 s; learner 2 runs at
    about half speed (SIGSTOP and SIGCONT in turn, 0.4 s each: on 2 shared cores that makes it a
    fraction of a second late per round, which an adaptive window would wait for). Rounds close
    on the quorum and grace, the slow learner's pushes come late and are merged into rounds of
    the fast ones, and no fast learner ever waits in a round longer than the grace plus a
    margin."""
    workdir = tmp_path / "run"
    proc = _launch(workdir, 3, "--config.syncer.quorum=2", "--config.syncer.grace=0.05",
                   "--config.syncer.adaptive_grace=false", "--config.syncer.max_late=8",
                   "--config.train.total_steps=160")  # fmt: skip
    _wait_until(lambda: any(e["event"] == "joined" and e["learner"] == 2
                            for e in _tape(workdir)))  # fmt: skip
    slow = _pid("diloco_jax.train", str(workdir / "learner_2"))
    done = threading.Event()

    def throttle():
        while not done.is_set():
            try:
                os.kill(slow, signal.SIGSTOP)
                time.sleep(0.4)
                os.kill(slow, signal.SIGCONT)
                time.sleep(0.4)
            except ProcessLookupError:
                return

    thread = threading.Thread(target=throttle, daemon=True)
    thread.start()
    try:
        _wait_until(lambda: _done(workdir / "learner_0") and _done(workdir / "learner_1"))
    finally:
        done.set()
        thread.join()
        try:
            os.kill(slow, signal.SIGCONT)
        except ProcessLookupError:
            pass
    _finish(proc)
    tape = _tape(workdir)
    closed = _closed(workdir)
    assert any(e["why"].startswith("quorum") for e in closed)
    # the slow learner's work is merged late, into rounds of the fast ones
    assert any(2 in e["late"] and e["learners"] == [0, 1, 2] for e in closed)
    # how long each fast push waited for its round to close
    pushed = {}
    waits = []
    for e in tape:
        if e["event"] == "pushed" and e["learner"] in (0, 1):
            pushed[e["learner"]] = e["time"]
        if e["event"] == "closed":
            waits += [e["time"] - pushed.pop(i) for i in (0, 1) if i in pushed and i in
                      e["learners"]]  # fmt: skip
    assert waits and max(waits) < 0.05 + 1.5, waits
