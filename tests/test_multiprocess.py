"""Several processes on localhost (gloo collectives, ports chosen free at test time): the same
result as one process and as the simulator; surviving SIGKILL, SIGTERM and Ctrl-C, the launcher's
death included."""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import chex
import jax
import pytest

from diloco_jax.config import apply_overrides, load_preset
from diloco_jax.launch import child_env, free_port
from diloco_jax.run.preemption import LAUNCHER_ENV
from diloco_jax.runtime import checkpoint
from diloco_jax.tasks import model as model_lib
from diloco_jax.train import train
from tests.helpers import events

ROOT = pathlib.Path(__file__).resolve().parent.parent
# 120 steps (~5 s of training after ~10 s of start-up) leave time to signal a run mid-way
OVERRIDES = {"train.total_steps": 120, "train.checkpoint_every": 10, "train.eval_every": 60,
             "train.sample_chars": 0}  # fmt: skip
TRAIN = [sys.executable, "-m", "diloco_jax.train", "--config", "configs/tiny.py",
         *[f"--config.{k}={v}" for k, v in OVERRIDES.items()]]  # fmt: skip


def tiny():
    return apply_overrides(load_preset(ROOT / "configs/tiny.py"),
                           [(k, str(v)) for k, v in OVERRIDES.items()])  # fmt: skip


def final_params(workdir: pathlib.Path):
    cfg = tiny()
    _, like = model_lib.init_model(cfg.seed, vocab_size=256, seq_len=cfg.data.seq_len,
                                   **dataclasses.asdict(cfg.model))  # fmt: skip
    return jax.device_get(checkpoint.load_params(workdir / "params", like))


def launch(workdir, *, processes=2, devices=1, extra=(), **popen):
    cmd = [sys.executable, "-m", "diloco_jax.launch", "-n", str(processes),
           "--devices_per_process", str(devices), "--grace", "10", "--", *TRAIN[3:],
           "--workdir", str(workdir), *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **popen)  # fmt: skip


def start_processes(workdir, count=2):
    """The processes of one run, started directly (not by the launcher)."""
    port = free_port()
    return [subprocess.Popen([*TRAIN, "--workdir", str(workdir)], cwd=ROOT, text=True,
                             env=child_env(i, count, port, 1), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE) for i in range(count)]  # fmt: skip


def wait_for(path: pathlib.Path, procs, timeout=180):
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} did not appear"
        for p in procs:
            assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)


def pids_running(workdir) -> list[int]:
    """Processes whose command line names ``workdir``."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(workdir) in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def process_with_id(workdir, process_id: int) -> int:
    """The pid of the run's process with ``JAX_PROCESS_ID == process_id``."""
    for pid in pids_running(workdir):
        try:
            environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"JAX_PROCESS_ID={process_id}".encode() in environ:
            return pid
    raise AssertionError(f"no process {process_id} of the run in {workdir}")


def finished(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out, err


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The reference: 2 processes x 1 CPU device, uninterrupted."""
    workdir = tmp_path_factory.mktemp("two")
    out, _ = finished(launch(workdir))
    assert "final eval loss" in out
    return workdir, final_params(workdir)


# with the Transformer's dropout: its masks must not depend on the process or device (issue 39)
SHORT = {"train.total_steps": 40, "train.eval_every": 20, "train.checkpoint_every": 0,
         "model.dropout": 0.1}  # fmt: skip


@pytest.fixture(scope="module")
def two_short(tmp_path_factory):
    """2 processes x 1 CPU device, 40 steps with dropout, no checkpoints."""
    workdir = tmp_path_factory.mktemp("two_short")
    finished(launch(workdir, extra=[f"--config.{k}={v}" for k, v in SHORT.items()]))
    assert [e["step"] for e in events(workdir, "eval")] == [20, 40]
    return final_params(workdir)


def test_two_processes_equal_the_simulator(two_short, tmp_path):
    """The processes' collectives and keys against one vmap in this process (its 8 fake devices:
    a key that folded in a process's device count would differ here too)."""
    over = [("parallel.runtime", "sim"), ("train.checkpoint", "false"),
            *[(k, str(v)) for k, v in SHORT.items()]]  # fmt: skip
    sim = jax.device_get(train(apply_overrides(tiny(), over), tmp_path / "sim",
                               show_progress=False)["state"].anchor)  # fmt: skip
    # vmap vs shard_map: float32 reassociation in the nested replica mean, 8 outer steps
    chex.assert_trees_all_close(sim, two_short, atol=2e-5)


@pytest.mark.slow  # ~20 s: a third process; by default test_two_processes_equal_the_simulator
def test_two_processes_equal_one_process_two_devices(two_short, tmp_path):
    flags = [f"--config.{k}={v}" for k, v in SHORT.items()]
    finished(launch(tmp_path / "one", processes=1, devices=2, extra=flags))
    # the same programs on the same values: gloo's all-reduce of two addends is exact
    chex.assert_trees_all_equal(final_params(tmp_path / "one"), two_short)


@pytest.mark.slow  # ~60 s; the default suite keeps the SIGTERM run and the launcher's SIGKILL tests
def test_sigkill_one_process_then_restart_equals_uninterrupted(two_processes, tmp_path):
    workdir = tmp_path / "w"
    proc = launch(workdir)
    wait_for(workdir / "checkpoints" / "20", [proc])
    os.kill(process_with_id(workdir, 1), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    # the launcher saw process 1 die, stopped process 0 and reports the failure
    assert proc.returncode != 0 and "process 1 exited with status -9" in err
    assert pids_running(workdir) == []
    saved = sorted(int(d.name) for d in (workdir / "checkpoints").iterdir() if d.name.isdigit())
    assert saved and max(saved) < 120, saved
    finished(launch(workdir))  # resumes from the newest complete checkpoint
    chex.assert_trees_all_equal(final_params(workdir), two_processes[1])
    # what the killed attempt logged past that checkpoint was dropped, then logged again once
    events = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    pairs = [(e["event"], e["step"]) for e in events]
    assert len(pairs) == len(set(pairs)) and ("done", 120) in pairs


@pytest.mark.slow  # ~55 s; the launcher's signal tests stay by default
def test_sigterm_to_one_process_stops_both_at_one_step_and_resumes_exactly(two_processes, tmp_path):
    workdir = tmp_path / "w"
    procs = start_processes(workdir)
    wait_for(workdir / "checkpoints" / "10", procs)
    procs[1].send_signal(signal.SIGTERM)
    outs = [finished(p)[0] for p in procs]
    assert "stopped by a signal to process 1 at step" in outs[0]
    stopped = int(outs[0].split("at step ")[1].split(";")[0])
    assert 10 <= stopped < 120
    assert (workdir / "checkpoints" / str(stopped)).is_dir()
    done = events(workdir, "done")
    assert done[-1]["step"] == stopped and done[-1]["preempted"]
    finished(launch(workdir))
    chex.assert_trees_all_equal(final_params(workdir), two_processes[1])


@pytest.mark.slow  # 25 s; the SIGKILL test also runs the launcher and checks no process is left
def test_launcher_passes_ctrl_c_on_and_leaves_no_process(tmp_path):
    workdir = tmp_path / "w"
    proc = launch(workdir)
    wait_for(workdir / "checkpoints" / "10", [proc])
    assert len(pids_running(workdir)) == 3  # the launcher and its two processes
    proc.send_signal(signal.SIGINT)
    out, err = finished(proc)
    assert "stopped by SIGINT at step" in out, err[-2000:]
    stopped = int(out.split("at step ")[1].split(";")[0])
    assert (workdir / "checkpoints" / str(stopped)).is_dir()
    assert pids_running(workdir) == []


VARIANT_FLAGS = {
    "delayed": ["--config.outer.mode=delayed"],
    "eager": ["--config.outer.mode=eager"],
    "overlap_int8_ef": ["--config.streaming.overlap=2", "--config.streaming.mix=0.5",
                        "--config.compress.codec=int8", "--config.compress.error_feedback=true",
                        "--config.compress.min_size=64"],
    "dct": ["--config.compress.codec=dct", "--config.compress.min_size=64"],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANT_FLAGS))
def test_two_processes_equal_one_process_for_each_variant(name, tmp_path):
    """Delayed and eager outer steps, overlapped syncs with an error-fed codec, DCT momentum: 2
    processes of 2 virtual replicas each compute what 1 process with 2 devices does, bitwise
    (each replica encodes its own pseudo-gradient; every sum over replicas runs in replica
    order)."""
    flags = ["--config.train.total_steps=40", "--config.train.eval_every=40",
             *VARIANT_FLAGS[name]]  # fmt: skip
    finished(launch(tmp_path / "two", extra=flags))
    finished(launch(tmp_path / "one", processes=1, devices=2, extra=flags))
    chex.assert_trees_all_equal(final_params(tmp_path / "one"), final_params(tmp_path / "two"))


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie that nobody reaped yet counts)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def test_processes_of_a_sigkilled_launcher_get_sigterm_once_then_are_killed_after_the_grace(
    tmp_path,
):
    # stand-ins for train: process 0 exits at SIGTERM, process 1 ignores it
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco_jax.launch", "-n", "2", "--grace", "1",
         "--module", "tests.launched_child", "--", str(tmp_path), "1"],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.time() + 120
    while len(list(tmp_path.glob("*.ready"))) < 2:
        assert time.time() < deadline and proc.poll() is None, "the processes did not start"
        time.sleep(0.05)
    pids = [int(p.stem) for p in tmp_path.glob("*.ready")]
    proc.kill()  # SIGKILL: the launcher passes nothing on and kills nothing
    # the processes hold the launcher's stdout and stderr until they end
    _, err = proc.communicate(timeout=30)
    deadline = time.time() + 10
    while not all(gone(pid) for pid in pids):
        assert time.time() < deadline, [pid for pid in pids if not gone(pid)]
        time.sleep(0.05)
    # one SIGTERM each (the kernel's on Linux; the watch thread does not send a second)
    assert [(tmp_path / f"{pid}.sigterm").read_text() for pid in pids] == ["SIGTERM\n"] * 2
    assert err.count("did not stop within 1 s: killing it") == 1, err[-3000:]


def test_without_the_kernel_signal_the_watch_thread_sends_sigterm_then_kills(tmp_path):
    # the portable path (no parent-death signal, as off Linux): a process whose launcher is gone
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    env = {**os.environ, "JAX_PROCESS_ID": "0", LAUNCHER_ENV: f"{dead.pid} 1"}
    cmd = [sys.executable, "-m", "tests.launched_child", str(tmp_path), "0"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert [p.read_text() for p in tmp_path.glob("*.sigterm")] == ["SIGTERM\n"]
    assert "did not stop within 1 s: killing it" in result.stderr


# 90-100 s on the shared 2-core VM; the two tests above check the launcher's tie with stand-ins
@pytest.mark.slow
def test_sigkill_of_the_launcher_stops_every_process_and_the_same_command_resumes(
    two_processes, tmp_path
):
    workdir = tmp_path / "w"
    proc = launch(workdir)
    wait_for(workdir / "checkpoints" / "10", [proc])
    assert len(pids_running(workdir)) == 3  # the launcher and its two processes
    proc.kill()
    out, err = proc.communicate(timeout=120)  # its processes hold its output until they end
    deadline = time.time() + 30
    while pids_running(workdir):
        assert time.time() < deadline, pids_running(workdir)
        time.sleep(0.1)
    # they took the graceful path: one step agreed, a checkpoint there
    assert "stopped by SIGTERM at step" in out, err[-3000:]
    stopped = int(out.split("at step ")[1].split(";")[0])
    saved = sorted(int(d.name) for d in (workdir / "checkpoints").iterdir() if d.name.isdigit())
    assert 10 <= stopped < 120 and saved[-1] == stopped, (stopped, saved)
    _, err = finished(launch(workdir))  # the same command
    assert f"resumed from {workdir / 'checkpoints'} at step {stopped}" in err
    chex.assert_trees_all_equal(final_params(workdir), two_processes[1])
