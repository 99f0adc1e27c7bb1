"""Issue 61: ``diloco-launch --learners N`` resumed by the same command, stopped cleanly by a
signal (every learner saves at its next sync before the syncer stops), a learner that cannot
reach its syncer saving before it gives up, and a syncer started by hand ending once its
learners have finished.

Default suite: the kept address, the flags each process gets, the order of a stop with fake
processes, a learner in this process stopped mid-round or left without its syncer, the
syncer's end on a test clock. Slow set (real processes, the tiny preset): the same command
twice around a SIGTERM, and a syncer by hand with its learner."""

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from diloco_jax.learners import service
from diloco_jax.run import local_learners
from diloco_jax.run.local_learners import LaunchError, LocalLearners, kept_address
from tests import helpers
from tests.test_learners import TOKEN, _algorithm, _ones, _syncer, _tiny

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- the address kept, the flags each process gets ------------------------------------------


def test_the_syncer_address_is_chosen_once_per_workdir_and_a_taken_one_is_said(tmp_path):
    """The first launch picks a free port and keeps it; the next launch reuses it; an address
    given replaces it; a kept port another process listens on is refused in one line naming it
    and the file; a run launched before the file (its learners' config) keeps its own."""
    first = kept_address(tmp_path)
    assert (tmp_path / "syncer_address").read_text().strip() == first
    assert kept_address(tmp_path) == first
    assert kept_address(tmp_path, "127.0.0.1:50551", taken=lambda h, p: False) == (
        "127.0.0.1:50551")  # fmt: skip
    assert kept_address(tmp_path) != first  # the address given is the run's now
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (tmp_path / "syncer_address").write_text(f"127.0.0.1:{port}\n")
        with pytest.raises(LaunchError, match=f"127.0.0.1:{port} .kept in .*syncer_address. "
                                              "is taken by another process"):  # fmt: skip
            kept_address(tmp_path)
    old = tmp_path / "old"
    (old / "learner_0").mkdir(parents=True)
    config = {"syncer": {"address": "127.0.0.1:39639"}}
    (old / "learner_0" / "config.json").write_text(json.dumps(config))
    assert kept_address(old, taken=lambda h, p: False) == "127.0.0.1:39639"


def _opts(learners: int = 2, grace: float = 30.0, max_restarts: int = 0,
          shards: int = 1) -> argparse.Namespace:  # fmt: skip
    return argparse.Namespace(learners=learners, grace=grace, max_restarts=max_restarts,
                              devices_per_process=1, module="diloco_jax.train",
                              shards=shards)  # fmt: skip


def test_syncer_shards_are_launched_each_with_its_address_workdir_and_credentials(tmp_path):
    """``--shards 2``: two free addresses kept as the run's (a later launch with another
    count refused in one line), shard 1 in DIR/shard_1 with its own certificate (named
    shard-1, good to serve and to call shard 0), every process told the shards."""
    from diloco_jax.learners import certs

    group = LocalLearners(_opts(shards=2), tmp_path, ["--config", "tiny"])
    addresses = group.address.split(",")
    assert len(set(addresses)) == 2
    assert (tmp_path / "syncer_address").read_text().strip() == group.address
    zero, one = group.syncer_argv(0), group.syncer_argv(1)
    assert zero[zero.index("--workdir") + 1] == str(tmp_path / "syncer")
    assert one[one.index("--workdir") + 1] == str(tmp_path / "shard_1")
    assert f"--config.syncer.credentials={tmp_path / 'credentials' / 'shard_1'}" in one
    assert "--config.syncer.shard=1" in one and "--config.syncer.shard=0" in zero
    for argv in (zero, one, group.learner_argv(0)):
        assert "--config.syncer.shards=2" in argv
        assert f"--config.syncer.address={group.address}" in argv
    pem = (tmp_path / "credentials" / "shard_1" / "cert.pem").read_bytes()
    assert certs.common_name(pem) == "shard-1"
    with pytest.raises(LaunchError, match="names 2 syncer.s., but --shards is 3"):
        LocalLearners(_opts(shards=3), tmp_path, ["--config", "tiny"])


def test_allow_config_change_goes_to_the_learners_and_the_address_to_every_process(tmp_path):
    rest = ["--config", "tiny", "--allow_config_change", "--config.syncer.address",
            "127.0.0.1:50552", "--config.train.total_steps=40"]  # fmt: skip
    group = LocalLearners(_opts(), tmp_path, rest)
    learner, syncer = group.learner_argv(1), group.syncer_argv()
    assert "--allow_config_change" in learner and "--allow_config_change" not in syncer
    for argv in (learner, syncer):
        assert argv.count("--config.syncer.address=127.0.0.1:50552") == 1
        assert "--config.syncer.address" not in argv and "--config.train.total_steps=40" in argv
    assert "--config.syncer.stay=true" in syncer  # the launcher stops it, in its turn
    again = LocalLearners(_opts(), tmp_path, ["--config", "tiny"])
    assert "--config.syncer.address=127.0.0.1:50552" in again.syncer_argv()


# ---- the order of a stop, with fake processes -------------------------------------------------

FAKE_SYNCER = """
import signal, socket, sys, time
out, (host, port) = sys.argv[1], sys.argv[2].rsplit(":", 1)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, int(port)))
s.listen()
def stop(*_):
    with open(out, "a") as f:
        f.write("syncer stopped\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(0.05)
"""
FAKE_LEARNER = """
import os, pathlib, signal, sys, time
out, i, stubborn = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def stop(*_):
    if stubborn:
        return
    time.sleep(0.5)  # on to its next sync, and its save
    with open(out, "a") as f:
        f.write(f"learner {i} saved\\n")
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(f"{out}.{i}.ready").touch()
while True:
    time.sleep(0.05)
"""


def _fakes(tmp_path: pathlib.Path, stubborn: bool = False, grace: float = 30.0):
    """A launch whose syncer and learners are stand-ins that write what they do to ``out``."""
    out = tmp_path / "out"
    group = LocalLearners(_opts(grace=grace), tmp_path, [])
    group.syncer_argv = lambda k=0: ["-c", FAKE_SYNCER, str(out), group.address]
    group.learner_argv = lambda i: ["-c", FAKE_LEARNER, str(out), str(i), str(int(stubborn))]
    group._die_with_launcher = None  # no Python between fork and exec in a process with JAX
    return group, out


def _signal_when_ready(out: pathlib.Path, signals: int = 1) -> threading.Thread:
    def send() -> None:
        while not all(pathlib.Path(f"{out}.{i}.ready").exists() for i in (0, 1)):
            time.sleep(0.02)
        for _ in range(signals):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_stop_lets_every_learner_save_before_the_syncer_stops(tmp_path, capfd):
    """SIGTERM to the launcher: the learners are asked first, each saves (half a second
    later) and ends, and only then is the syncer stopped; the launcher says so at once."""
    group, out = _fakes(tmp_path)
    _signal_when_ready(out)
    assert group.run() == 0
    lines = out.read_text().splitlines()
    assert sorted(lines[:2]) == ["learner 0 saved", "learner 1 saved"]
    assert lines[2:] == ["syncer stopped"]
    err = capfd.readouterr().err
    assert ("launch: SIGTERM: stopping: learners save at their next sync, then the syncer stops; "
            "Ctrl-C again to stop at once, losing no steps") in err  # fmt: skip


def test_a_second_signal_kills_the_learners_and_says_what_they_lose(tmp_path, capfd):
    """Learners that do not stop: the second signal kills them, naming the steps each trained
    since its newest checkpoint (from its metrics and checkpoints); then the syncer stops."""
    learner_0 = tmp_path / "learner_0"
    (learner_0 / "checkpoints" / "20250").mkdir(parents=True)
    (learner_0 / "metrics.jsonl").write_text(
        json.dumps({"event": "train", "step": 27125}) + "\n" +
        json.dumps({"event": "eval", "step": 27125}) + "\n")  # fmt: skip
    group, out = _fakes(tmp_path, stubborn=True)
    _signal_when_ready(out, signals=2)
    assert group.run() == -signal.SIGKILL
    assert out.read_text().splitlines() == ["syncer stopped"]
    err = capfd.readouterr().err
    lost = "losing up to 6,875 steps (learner 0: steps 20,250-27,125)"
    assert f"Ctrl-C again to stop at once, {lost}" in err
    assert f"launch: SIGTERM again: stopping at once, {lost}" in err


def test_learners_still_running_after_the_grace_are_killed_then_the_syncer_stops(
        tmp_path, capfd):  # fmt: skip
    group, out = _fakes(tmp_path, stubborn=True, grace=1.0)
    _signal_when_ready(out)
    assert group.run() == -signal.SIGKILL
    assert out.read_text().splitlines() == ["syncer stopped"]
    assert "learners still running 1 s after the stop (--grace): killing them" in (
        capfd.readouterr().err)  # fmt: skip


# ---- a learner in this process: stopped mid-round, or without its syncer ----------------------


def _serving(tmp_path, keys: dict, monkeypatch):
    from diloco_jax.learners.command import make_syncer

    syncer = make_syncer(_tiny(**keys), tmp_path / "syncer")
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    monkeypatch.setenv("DILOCO_SERVE_TOKEN", TOKEN)
    return syncer, server, _tiny(**keys, **{"syncer.address": f"127.0.0.1:{server.port}"})


def _newest_checkpoint(workdir: pathlib.Path) -> int:
    return max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_learner_signalled_mid_round_saves_at_its_next_sync(tmp_path, monkeypatch):
    """SIGTERM at step 5 of a 10-step round: the learner trains on to step 10, pushes, restarts
    from the answer and saves there, so its checkpoint and the syncer's anchor hold the same
    round (a learner stopped at step 5 would lose those steps at its rejoin)."""
    from diloco_jax.run import loop
    from diloco_jax.train import train

    keys = {"parallel.replicas": 1, "outer.sync_every": 10, "train.total_steps": 30,
            "train.checkpoint_minutes": 0}  # fmt: skip
    syncer, server, cfg = _serving(tmp_path, keys, monkeypatch)
    report = loop._report_chunk

    def signalled_at_5(s, runlog, bar, step, *rest):
        report(s, runlog, bar, step, *rest)
        if step == 5:
            signal.raise_signal(signal.SIGTERM)  # the handler runs before this returns

    monkeypatch.setattr(loop, "_report_chunk", signalled_at_5)
    try:
        got = train(cfg, tmp_path / "learner", show_progress=False)
    finally:
        server.stop()
        syncer.close()
    assert got["preempted"] == "SIGTERM" and got["steps"] == 10
    assert syncer.round == 1 and _newest_checkpoint(tmp_path / "learner") == 10
    assert [e["step"] for e in helpers.events(tmp_path / "learner", "round")] == [10]


def test_a_signal_shortens_a_learners_patience_with_a_syncer_it_cannot_reach():
    """The signal's handler calls the loop's hooks: a learner's calls then give up on an
    unreachable syncer after ``STOP_PATIENCE`` seconds, not the client's minutes, so that it
    saves within the launcher's grace."""
    from types import SimpleNamespace

    from diloco_jax.learners.learner import STOP_PATIENCE, Learner
    from diloco_jax.run.preemption import Preemption

    learner = SimpleNamespace(client=SimpleNamespace(patience=300.0))
    with Preemption() as stop:
        stop.hooks.append(lambda: Learner.stopping(learner))
        signal.raise_signal(signal.SIGTERM)  # the handler runs before this returns
    assert stop.requested == "SIGTERM" and learner.client.patience == STOP_PATIENCE < 30


def test_a_learner_whose_syncer_is_gone_saves_before_it_gives_up(tmp_path, monkeypatch):
    """The syncer stops after round 0; the learner's next push finds nobody, and once its
    client's patience (1 s here) is spent it saves its state at that sync's step, then fails."""
    from diloco_jax.learners import learner as learner_lib
    from diloco_jax.train import train

    keys = {"parallel.replicas": 1, "train.total_steps": 40, "train.checkpoint_minutes": 0}
    syncer, server, cfg = _serving(tmp_path, keys, monkeypatch)
    made, connect = [], learner_lib.connect

    def impatient(*args, **kwargs):
        made.append(connect(*args, **kwargs))
        made[-1].client.patience = 1.0
        return made[-1]

    def stop_after_round_0() -> None:
        with syncer.lock:
            while syncer.round < 1:
                syncer.lock.wait(0.05)
        server.stop(grace=0)

    monkeypatch.setattr(learner_lib, "connect", impatient)
    thread = threading.Thread(target=stop_after_round_0)
    thread.start()
    try:
        with pytest.raises(service.SyncerUnreachable):
            train(cfg, tmp_path / "learner", show_progress=False)
    finally:
        thread.join()
        syncer.close()
        for learner in made:
            learner._stop.set()  # its heartbeats end with the test
    synced = [e["step"] for e in helpers.events(tmp_path / "learner", "round")]
    failed_at = max([0, *synced]) + 5  # the sync after its last answered one (sync_every 5)
    assert _newest_checkpoint(tmp_path / "learner") == failed_at < 40
    assert helpers.events(tmp_path / "learner", "checkpoint")[-1]["step"] == failed_at


# ---- the syncer by hand ends when its learners have finished -------------------------------


def test_the_run_is_over_when_every_declared_learner_has_left_at_its_end(tmp_path):
    """Two learners, rounds of 3 steps, ``train.total_steps`` 5 (two rounds: a learner's loop
    rounds 5 up to 6). Learners that leave before round 2 were stopped: the syncer stays; once
    both have left after round 2, or after ``syncer.rounds``, the run is over."""
    from diloco_jax.learners import wire
    from diloco_jax.learners.command import run_over

    x = {"w": np.zeros(3, np.float32)}
    keys = {"outer.sync_every": 3}
    syncer = _syncer(tmp_path, _algorithm(), learners=2)
    try:
        for i in (0, 1):
            syncer.join(i, wire.describe(x), keys, wire.named(x))
        for i in (0, 1):
            syncer.push(i, 1, 0, 1.0, _ones(1.0))
        syncer.leave(1, 1)
        assert not run_over(syncer, 5, 3)  # learner 0 is still there
        syncer.leave(0, 1)
        assert syncer.round == 1 and not run_over(syncer, 5, 3)  # stopped, not finished
        for i in (0, 1):
            syncer.join(i, wire.describe(x), keys, wire.named(x))
        for i in (0, 1):
            syncer.push(i, 2, 1, 1.0, _ones(1.0))
        for i in (0, 1):
            syncer.leave(i, 2)
        assert syncer.round == 2 and run_over(syncer, 5, 3)
        assert not run_over(syncer, 7, 3)  # 9 steps: three rounds
    finally:
        syncer.close()
    capped = _syncer(tmp_path / "capped", _algorithm(), learners=1, rounds=1)
    try:
        capped.join(0, wire.describe(x), keys, wire.named(x))
        capped.push(0, 1, 0, 1.0, _ones(1.0))
        capped.leave(0, 1)
        assert capped.finished and run_over(capped, 300, 3)
    finally:
        capped.close()


# ---- real processes --------------------------------------------------------------------------

RUN = ["--config", "tiny", "--config.parallel.replicas=1", "--config.outer.sync_every=10",
       "--config.train.log_every=5", "--config.train.checkpoint_every=0",
       "--config.train.checkpoint_minutes=0", "--config.train.sample_chars=0",
       "--config.log.figures=false", "--config.syncer.heartbeat=0.5"]  # fmt: skip


class _Launch:
    """``diloco-launch --learners 2`` of :data:`RUN` in ``workdir``, its output read as it
    comes, each line with the time it came."""

    def __init__(self, workdir: pathlib.Path, total: int, *launcher: str):
        command = [sys.executable, "-m", "diloco_jax.launch", "--learners", "2", *launcher,
                   "--", *RUN, f"--config.train.total_steps={total}", "--workdir",
                   str(workdir)]  # fmt: skip
        env = helpers.child_env(TQDM_DISABLE="1")
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def finish(self, seconds: float = 180.0) -> str:
        try:
            self.proc.wait(seconds)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(10)
        out = "".join(line for _, line in self.lines)
        assert self.proc.returncode == 0, out[-4000:]
        return out


def _tape(workdir: pathlib.Path, shard: str = "syncer") -> list[dict]:
    path = workdir / shard / "syncer.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def _closed(workdir: pathlib.Path) -> list[dict]:
    return [e for e in _tape(workdir) if e["event"] == "closed"]


def _stopped_mid_run(workdir: pathlib.Path) -> tuple[float | None, str]:
    """A launch of 400 steps a learner, SIGTERMed once round 2 has closed: the seconds its
    line took to come (None: it never came), and its output."""
    launch = _Launch(workdir, 400)
    end = time.monotonic() + 150
    while len(_closed(workdir)) < 2:
        assert time.monotonic() < end and launch.proc.poll() is None, "the run did not start"
        time.sleep(0.05)
    sent = time.monotonic()
    launch.proc.send_signal(signal.SIGTERM)
    out = launch.finish()
    said = [t for t, line in launch.lines if "stopping: learners save at their next sync" in line]
    return (said[0] - sent if said else None), out


@pytest.mark.slow  # ~40 s on 2 cores; stand-ins: the fake processes' stop, the mid-round learner
def test_sigterm_to_the_launcher_saves_every_learner_at_its_last_sync(tmp_path):
    """The launcher says what it does within a second; every learner trains on to its next
    sync, saves there and ends; the syncer's rounds hold exactly the learners' work: each
    learner's newest checkpoint is its last sync and the syncer's round times 10 steps."""
    seconds, out = _stopped_mid_run(tmp_path)
    assert seconds is not None and seconds < 1.0, out[-3000:]
    rounds = len(_closed(tmp_path))
    assert all(e["learners"] == [0, 1] for e in _closed(tmp_path))
    for i in (0, 1):
        workdir = tmp_path / f"learner_{i}"
        last_sync = helpers.events(workdir, "round")[-1]["step"]
        assert _newest_checkpoint(workdir) == last_sync == 10 * rounds < 400, out[-3000:]
    assert f"syncer stopping at round {rounds}" in out


@pytest.mark.slow  # ~70 s on 2 cores; stand-ins: the kept address, the flags, the stop's order
def test_the_same_launch_command_resumes_a_stopped_run(tmp_path):
    """Launched, SIGTERMed mid-run, launched again with the same command: the syncer restores
    its round R, each learner resumes from its checkpoint at step 10 R (nothing trained twice,
    nothing skipped), and the rounds go on contiguous to the end, each with both learners and
    one push of each."""
    _stopped_mid_run(tmp_path)
    out = _Launch(tmp_path, 400).finish()
    tape = _tape(tmp_path)
    restored = next(e for e in tape if e["event"] == "restored")["round"]
    assert 2 <= restored < 40
    for i in (0, 1):
        starts = [json.loads(x)["step"]
                  for x in (tmp_path / f"learner_{i}" / "run_record.jsonl").open()]  # fmt: skip
        assert starts == [0, 10 * restored], out[-3000:]
    closed = _closed(tmp_path)
    assert [e["closed"] for e in closed] == list(range(40))
    assert all(e["learners"] == [0, 1] for e in closed)
    for i in (0, 1):
        assert sum(e["event"] == "pushed" and e["learner"] == i for e in tape) == 40
    assert not [e for e in tape if e["event"] in ("refused", "dropped")]


@pytest.mark.slow  # ~30 s on 2 cores; stand-in: the run's end on a test clock above
def test_a_syncer_started_by_hand_exits_0_once_its_learners_have_finished(tmp_path):
    address = f"--config.syncer.address=127.0.0.1:{local_learners.free_port()}"
    env = helpers.child_env(DILOCO_SERVE_TOKEN=TOKEN, TQDM_DISABLE="1")

    def start(module: str, workdir: str, *extra: str) -> subprocess.Popen:
        command = [sys.executable, "-m", module, *RUN, "--config.train.total_steps=20",
                   "--workdir", str(tmp_path / workdir), address, *extra]  # fmt: skip
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip

    syncer = start("diloco_jax.syncer", "syncer")
    learner = start("diloco_jax.train", "learner")
    try:
        learned, _ = learner.communicate(timeout=150)
        assert learner.returncode == 0, learned[-3000:]
        said, _ = syncer.communicate(timeout=30)
    finally:
        for p in (syncer, learner):
            if p.poll() is None:
                p.kill()
    assert syncer.returncode == 0 and "every learner has finished" in said, said[-3000:]


def _pid_of(*words: str) -> int:
    """The process whose command line holds every one of ``words``."""
    for proc in pathlib.Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if proc.name.isdigit() and all(w in argv for w in words):
            return int(proc.name)
    raise AssertionError(f"no process of {words}")


def _sharded_run(workdir: pathlib.Path, kills: list[tuple[str, str, int]]) -> str:
    """A launch of 2 learners and 2 syncer shards, 200 steps (20 rounds); each of ``kills``
    ``(shard folder, the folder whose tape is watched, after how many closed rounds)``
    SIGKILLs that shard once the watched tape has closed that many rounds (the launcher starts
    it again)."""
    launch = _Launch(workdir, 200, "--shards", "2", "--max_restarts", "2")
    for folder, watched, after in kills:
        end = time.monotonic() + 240
        while sum(e["event"] == "closed" for e in _tape(workdir, watched)) < after:
            assert time.monotonic() < end and launch.proc.poll() is None, "the run stalled"
            time.sleep(0.05)
        os.kill(_pid_of("diloco_jax.syncer", "--workdir", str(workdir / folder)), signal.SIGKILL)
    return launch.finish(400)


@pytest.mark.slow  # ~3 min on 2 cores; stand-ins: test_shards.py's shard restarted mid-round,
# test_shards_wire.py's learners over gRPC against two shards
def test_killing_either_syncer_shard_mid_run_changes_no_round_and_no_bit(tmp_path):
    """Shard 1 SIGKILLed after round 3, shard 0 after round 8, each started again by the
    launcher: every learner goes on; no round is closed twice or with other learners on
    either shard (each of the 20, both learners, shard 1 as shard 0 decided); each shard's
    last anchor (its hash in the tape) and each learner's final evaluation are those of the
    same launch without a kill."""
    calm, killed = tmp_path / "calm", tmp_path / "killed"
    _sharded_run(calm, [])
    out = _sharded_run(killed, [("shard_1", "syncer", 3), ("syncer", "shard_1", 8)])
    assert out.count("exited with status -9; starting it again") == 2, out[-4000:]
    for shard in ("syncer", "shard_1"):
        want = [e for e in _tape(calm, shard) if e["event"] == "closed"]
        got = [e for e in _tape(killed, shard) if e["event"] == "closed"]
        rounds = [e["closed"] for e in got]
        assert len(set(rounds)) == len(rounds) and rounds[-1] == 19, (shard, rounds)
        assert all(e["learners"] == [0, 1] for e in got)
        assert got[-1]["anchor"] == want[-1]["anchor"], shard
        if shard == "shard_1":
            assert {e["why"] for e in got} == {"decided"}
        restored = [e["round"] for e in _tape(killed, shard) if e["event"] == "restored"]
        assert len(restored) == 1, (shard, restored)
    for i in (0, 1):
        done = [helpers.events(w / f"learner_{i}", "done")[-1] for w in (calm, killed)]
        assert done[0]["final_eval_loss"] == done[1]["final_eval_loss"]
