"""Checkpoints: exact continuation, fallback from a corrupt latest one, clear mismatch errors,
graceful stop on SIGTERM; a resume checks the config and keeps config history and metrics
straight."""

import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from diloco_jax import config as config_lib
from diloco_jax import train as train_lib
from diloco_jax.base import commandline
from diloco_jax.config import apply_overrides, cli, load_preset
from diloco_jax.run import loop, resume
from diloco_jax.run.preemption import Preemption
from diloco_jax.run.setup import build
from diloco_jax.runtime import checkpoint
from diloco_jax.runtime.checkpoint import CheckpointError
from diloco_jax.train import main, train
from diloco_jax.watch import reporting
from tests.helpers import events

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny(**overrides):
    base = {"parallel.runtime": "sim", "train.sample_chars": 0, "train.checkpoint_every": 10}
    items = {**base, **overrides}.items()
    return apply_overrides(load_preset("configs/tiny.py"), [(k, str(v)) for k, v in items])


def assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_each_event_once(workdir):
    pairs = [(e["event"], e["step"]) for e in events(workdir)]
    assert len(pairs) == len(set(pairs)), sorted(p for p in pairs if pairs.count(p) > 1)


def history(workdir):
    lines = (workdir / "config_history.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def files(workdir):
    """Every file under ``workdir`` with its bytes: to check that nothing changed."""
    return {p.relative_to(workdir): p.read_bytes() for p in workdir.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A finished tiny run (checkpoints at 10 and 20) and its final state; copy it to use it."""
    workdir = tmp_path_factory.mktemp("full")
    return workdir, train(tiny(), workdir, show_progress=False)["state"]


@pytest.fixture(scope="module")
def uninterrupted(full_run):
    return full_run[1]


@pytest.fixture
def finished(full_run, tmp_path):
    """A copy of the finished run's workdir."""
    return pathlib.Path(shutil.copytree(full_run[0], tmp_path / "w"))


def test_resume_from_a_middle_checkpoint_is_bitwise_identical(uninterrupted, tmp_path):
    train(tiny(), tmp_path, show_progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10", "20"]
    # as if the run had died after its step-10 checkpoint
    shutil.rmtree(tmp_path / "checkpoints" / "20")
    resumed = train(tiny(), tmp_path, show_progress=False)
    assert resumed["steps"] == 20
    assert_bitwise_equal(resumed["state"], uninterrupted)
    # the events past step 10 were dropped and written again, once
    assert_each_event_once(tmp_path)
    assert [e["step"] for e in events(tmp_path) if e["event"] == "eval"] == [10, 20]
    [entry] = history(tmp_path)
    assert entry["step"] == 10 and entry["changes"] == {} and entry["overridden"] == []
    assert entry["checkpoint"] == str((tmp_path / "checkpoints" / "10").resolve())


def test_the_final_checkpoint_written_during_the_last_evaluation_is_the_final_state(
    uninterrupted, tmp_path
):
    """checkpoint_every 15 of 20 steps: step 15 is periodic (its event logged), step 20 the
    final one, started before the last evaluation (issue 28); it holds the returned state."""
    cfg = tiny(**{"train.checkpoint_every": 15})
    summary = train(cfg, tmp_path, show_progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["15", "20"]
    assert [e["step"] for e in events(tmp_path) if e["event"] == "checkpoint"] == [15]
    assert [e["step"] for e in events(tmp_path) if e["event"] == "eval"] == [10, 20]
    assert_each_event_once(tmp_path)
    mngr = checkpoint.manager(tmp_path)
    assert_bitwise_equal(checkpoint.restore(mngr, build(cfg).state), summary["state"])
    assert_bitwise_equal(summary["state"], uninterrupted)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(uninterrupted, tmp_path):
    train(tiny(), tmp_path, show_progress=False)
    latest = tmp_path / "checkpoints" / "20"
    for path in latest.rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "metadata" not in path.name:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncate
    resumed = train(tiny(), tmp_path, show_progress=False)
    assert resumed["steps"] == 20
    assert_bitwise_equal(resumed["state"], uninterrupted)


def test_mismatched_model_names_the_parameter_and_both_shapes(tmp_path):
    train(tiny(), tmp_path, show_progress=False)
    expected = (r"params/blocks/0/attn/out/kernel has shape \(4, 32, 32\) in the checkpoint "
                r"but \(4, 16, 16\) in this run")  # fmt: skip
    with pytest.raises(CheckpointError, match=expected):
        train(tiny(**{"model.d_model": 16}), tmp_path, show_progress=False)
    assert (tmp_path / "checkpoints" / "20").is_dir()  # nothing was lost


@pytest.mark.slow  # 25 s; test_multiprocess covers the same stop with two processes
def test_sigterm_stops_with_a_checkpoint_and_resume_continues_exactly(tmp_path):
    over = {"train.total_steps": 1500, "train.log_every": 5, "train.eval_every": 1500}
    workdir = tmp_path / "w"
    cmd = [sys.executable, "-m", "diloco_jax.train", "--config", "configs/tiny.py",
           "--workdir", str(workdir), "--config.parallel.runtime=sim",
           "--config.train.sample_chars=0",
           *[f"--config.{k}={v}" for k, v in over.items()]]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and '"train"' in metrics.read_text()):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM at step" in out
    stopped = int(out.split("at step ")[1].split(";")[0])
    assert 0 < stopped < 1500
    assert (workdir / "checkpoints" / str(stopped)).is_dir()
    done = events(workdir, "done")
    assert done[-1]["preempted"] == "SIGTERM"
    cfg = tiny(**{"train.checkpoint_every": 0, **over})
    resumed = train(cfg, workdir, show_progress=False)
    full = train(cfg, tmp_path / "full", show_progress=False)
    assert_bitwise_equal(resumed["state"], full["state"])
    assert_each_event_once(workdir)


def test_sigterm_with_checkpoint_off_stops_without_saving_and_says_so(tmp_path, monkeypatch,
                                                                     capsys):  # fmt: skip
    class SignalledAtOnce(Preemption):
        def __enter__(self):
            super().__enter__()
            assert self._previous, "no handler: SIGTERM would end the test run"
            signal.raise_signal(signal.SIGTERM)  # the handler runs before this returns
            return self

    monkeypatch.setattr(train_lib, "Preemption", SignalledAtOnce)
    # the baseline without replicas: the quickest to compile, and stopping is the same for all
    flags = ["--config", "configs/tiny.py", "--workdir", str(tmp_path), "--config.algorithm=single",
             "--config.parallel.runtime=sim", "--config.train.checkpoint=false"]  # fmt: skip
    assert main(flags) == 0
    out, err = capsys.readouterr()
    assert "SIGTERM: stopping at step 0 without a checkpoint (train.checkpoint=false)" in err
    assert "stopped by SIGTERM at step 0; nothing saved (train.checkpoint=false)" in out
    assert not (tmp_path / "checkpoints").exists()
    assert events(tmp_path)[-1]["preempted"] == "SIGTERM"


def test_cli_mismatched_checkpoint_is_one_line_exit_2(tmp_path):
    train(tiny(), tmp_path, show_progress=False)
    result = subprocess.run(
        [sys.executable, "-m", "diloco_jax.train", "--config", "configs/tiny.py",
         "--workdir", str(tmp_path), "--config.model.d_model=16"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: checkpoint ") and "(4, 16, 16) in this run" in lines[0]


# 2 -> 4 is slow-marked (10 s): 4 -> 2 checks the same restore path in the default suite
@pytest.mark.parametrize("saved,resumed", [(4, 2), pytest.param(2, 4, marks=pytest.mark.slow)])
def test_elastic_restart_keeps_anchor_and_outer_state(saved, resumed, tmp_path, capsys):
    first = train(tiny(**{"parallel.replicas": saved}), tmp_path, show_progress=False)["state"]
    at_10 = jax.device_get(checkpoint.restore(checkpoint.manager(tmp_path), first, 10))
    shutil.rmtree(tmp_path / "checkpoints" / "20")  # as if the run had died after step 10
    cfg = tiny(**{"parallel.replicas": resumed})  # the replica count may change on a resume
    s = build(cfg)
    state = jax.device_get(resume.resume(checkpoint.manager(tmp_path), s, tmp_path).state)
    assert "elastic restart at step 10" in capsys.readouterr().err
    assert int(state.step) == 10
    assert_bitwise_equal(state.anchor, at_10.anchor)
    assert_bitwise_equal(state.outer_state, at_10.outer_state)
    for leaf, a in zip(jax.tree.leaves(state.params), jax.tree.leaves(at_10.anchor),
                       strict=True):  # fmt: skip
        assert leaf.shape[0] == resumed
        np.testing.assert_array_equal(leaf, np.broadcast_to(a, leaf.shape))
    # and the run goes on from there
    summary = train(cfg, tmp_path, show_progress=False)
    assert summary["steps"] == 20 and np.isfinite(summary["final_eval_loss"])
    [entry] = history(tmp_path)
    assert entry["changes"] == {"parallel.replicas": [saved, resumed]}
    assert entry["overridden"] == []
    assert_each_event_once(tmp_path)


def test_changed_training_key_stops_with_one_line_exit_2_and_changes_nothing(finished, capsys):
    before = files(finished)
    flags = ["--config", "configs/tiny.py", "--workdir", str(finished), "--distributed", "off",
             "--config.inner.learning_rate=0.001", "--config.parallel.runtime=sim"]  # fmt: skip
    assert main(flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (
        "error: config key inner.learning_rate = 0.001 differs from the checkpoint's 0.003 "
        f"({finished.resolve()}/checkpoints/20); pass --allow_config_change (from Python: "
        "allow_config_change=True) to resume with the new value"
    )
    assert not [line for line in lines[:-1] if "error" in line or "Traceback" in line]
    assert files(finished) == before  # nothing lost, nothing written


def test_allow_config_change_resumes_and_records_the_change(finished, capsys):
    before = files(finished)
    flags = ["--config", "configs/tiny.py", "--workdir", str(finished), "--distributed", "off",
             "--config.inner.learning_rate=0.001", "--allow_config_change",
             "--config.parallel.runtime=sim", "--config.train.sample_chars=0",
             "--config.train.checkpoint_every=10"]  # fmt: skip
    assert main(flags) == 0
    assert "inner.learning_rate 0.003 -> 0.001" in capsys.readouterr().err
    [entry] = history(finished)
    assert entry["step"] == 20 and entry["changes"] == {"inner.learning_rate": [0.003, 0.001]}
    assert entry["overridden"] == ["inner.learning_rate"]
    assert entry["config"]["inner"]["learning_rate"] == 0.001
    # config.json stays the first start's; the finished run's eval and done are not repeated
    for name in ("config.json", "metrics.jsonl"):
        assert files(finished)[pathlib.Path(name)] == before[pathlib.Path(name)]


def test_allowed_keys_may_change_and_the_run_continues_bitwise(uninterrupted, finished):
    shutil.rmtree(finished / "checkpoints" / "20")  # as if the run had died after step 10
    cfg = tiny(**{"train.log_every": 10, "train.eval_every": 20})  # other calls, same steps
    resumed = train(cfg, finished, show_progress=False)
    assert resumed["steps"] == 20
    assert_bitwise_equal(resumed["state"], uninterrupted)
    [entry] = history(finished)
    assert entry["changes"] == {"train.log_every": [5, 10], "train.eval_every": [10, 20]}
    assert entry["overridden"] == []
    assert_each_event_once(finished)
    # the new checkpoint carries the config that wrote it
    saved = checkpoint.saved_meta(checkpoint.manager(finished), 20)["config"]
    assert saved == config_lib.to_dict(cfg)


def test_old_schema_checkpoint_is_one_clear_line(tmp_path):
    cfg = tiny()
    old = ocp.CheckpointManager((tmp_path / "checkpoints").resolve(),
                                options=ocp.CheckpointManagerOptions(create=True))  # fmt: skip
    old.save(5, args=ocp.args.StandardSave(build(cfg).state))  # the layout of schema 1
    old.close()  # waits for the save
    assert (tmp_path / "checkpoints" / "5" / "default").is_dir()
    before = files(tmp_path)
    expected = (f"checkpoint {tmp_path.resolve()}/checkpoints/5 was written by an older version "
                "of diloco-jax (schema 1, this is 2); ")  # fmt: skip
    with pytest.raises(CheckpointError, match="^" + re.escape(expected)) as error:
        train(cfg, tmp_path, show_progress=False)
    assert "\n" not in str(error.value)
    assert files(tmp_path) == before


def test_config_changes_and_the_keys_a_resume_may_change():
    cfg = tiny(**{"inner.learning_rate": 0.001, "train.eval_every": 5})
    saved = config_lib.to_dict(tiny())
    assert resume.config_changes(saved, cfg) == {
        "inner.learning_rate": (0.003, 0.001), "train.eval_every": (10, 5)}  # fmt: skip
    # a key the checkpoint's version did not have counts as its default; one it had is listed
    del saved["sim"]["diagnostics"]
    saved["outer"]["gone"] = 1
    changes = resume.config_changes(saved, tiny())
    assert changes == {"outer.gone": (1, resume.ABSENT)}
    assert set(resume.MAY_CHANGE) <= set(config_lib.keys(cfg))  # no misspelt key


def test_runlog_drops_events_past_the_start_step_and_writes_each_once(tmp_path):
    lines = [json.dumps({"event": e, "step": s}) for e, s in
             [("train", 5), ("eval", 10), ("train", 10), ("train", 15), ("eval", 20)]]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"event": "tr')  # torn
    runlog = reporting.RunLog(tmp_path, start_step=10)
    runlog.write("eval", 10, eval_loss=1.0)  # already there: a finished run evaluated again
    runlog.write("train", 15, loss=2.0)
    runlog.close()
    got = [(e["event"], e["step"]) for e in events(tmp_path)]
    assert got == [("train", 5), ("eval", 10), ("train", 10), ("train", 15)]
    assert "loss" in events(tmp_path)[-1]  # the new one, not the dropped one


def test_cli_allow_config_change_is_a_switch_of_train_only(tmp_path):
    args = cli.parse(["--allow_config_change", "--workdir", str(tmp_path)], prog="t", resume=True)
    assert args.allow_config_change and args.workdir == tmp_path
    assert not cli.parse(["--workdir", str(tmp_path)], prog="t", resume=True).allow_config_change
    with pytest.raises(SystemExit):
        cli.parse(["--allow_config_change"], prog="python -m sim")


def test_checkpoints_are_orbaxs_standard_format_both_ways(full_run, uninterrupted, tmp_path):
    """This package's saves are read by orbax's own StandardCheckpointer, and a checkpoint that
    orbax's own handlers wrote (schema 2) is restored by this package."""
    workdir, _ = full_run
    like = jax.tree.map(ocp.utils.to_shape_dtype_struct, uninterrupted)
    with ocp.StandardCheckpointer() as plain:
        read = plain.restore((workdir / "checkpoints" / "20" / "state").resolve(), like)
    assert_bitwise_equal(read, uninterrupted)
    meta = checkpoint.saved_meta(checkpoint.manager(workdir), 20)
    theirs = ocp.CheckpointManager((tmp_path / "checkpoints").resolve(),
                                   options=ocp.CheckpointManagerOptions(create=True))  # fmt: skip
    theirs.save(20, args=ocp.args.Composite(state=ocp.args.StandardSave(uninterrupted),
                                            meta=ocp.args.JsonSave(meta)))  # fmt: skip
    theirs.close()
    assert_bitwise_equal(checkpoint.restore(checkpoint.manager(tmp_path), uninterrupted, 20),
                         uninterrupted)  # fmt: skip


def test_saving_a_replicated_array_compiles_nothing(tmp_path):
    """orbax's default (replica-parallel) saving compiles a slice per shape and device that
    holds a copy; this package's writes each array once and compiles nothing."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = {"w": jax.device_put(np.arange(6 * 14, dtype=np.float32).reshape(6, 14), replicated)}
    compiles, listening = [], [True]

    def listen(event, seconds, **kwargs):
        if listening[0] and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        checkpoint.save_params(tmp_path / "ours", params)
        ours = len(compiles)
        with ocp.StandardCheckpointer() as plain:  # the control: orbax's default slices
            plain.save((tmp_path / "theirs").resolve(), params)
        theirs = len(compiles) - ours
    finally:
        listening[0] = False
    assert ours == 0 and theirs > 0, (ours, theirs)
    read = checkpoint.load_params(tmp_path / "ours", params)
    np.testing.assert_array_equal(np.asarray(read["w"]), np.asarray(params["w"]))


# --- saves by time, the command that continues a run, a stop's last lines (issue 54) ----------


@pytest.mark.parametrize("sync_every,saved", [(5, [5, 10, 15, 20]), (10, [10, 20])])
def test_a_run_saves_by_time_at_the_first_sync_after_its_minutes(sync_every, saved, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    """train.checkpoint_minutes passed at every call: a save at every sync, and only there
    (the stretch for slow saves is off here: the next test has it)."""
    monkeypatch.setattr(loop.SaveClock, "MAX_SHARE", float("inf"))
    cfg = tiny(**{"train.checkpoint_every": 0, "train.checkpoint_minutes": 1e-9,
                  "train.keep_checkpoints": 5, "outer.sync_every": sync_every})  # fmt: skip
    train(cfg, tmp_path, show_progress=False)
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == saved
    assert [e["step"] for e in events(tmp_path) if e["event"] == "checkpoint"] == saved[:-1]


def test_the_save_clock_saves_soon_after_the_start_then_ever_less_often_up_to_its_minutes():
    """Issue 61 finding 5: a run killed 2.5 minutes after its start had no checkpoint. The
    first save is due 15 s after training starts (an eighth of the default 2 minutes), each
    later one twice as long after the one before, up to the 2 minutes; a save that blocks long
    stretches the wait so that saving holds the loop at most 2% of the time."""
    now = [100.0]
    clock = loop.SaveClock(2.0, now=lambda: now[0])
    now[0] += 50.0  # the compile: not training time
    clock.started()
    waits = []
    for _ in range(6):
        waited = 0.0
        while not clock.due():
            now[0] += 0.5
            waited += 0.5
        waits.append(waited)
        clock.saved(blocked_s=0.01)
    assert waits == [15.0, 30.0, 60.0, 120.0, 120.0, 120.0]
    clock.saved(blocked_s=6.0)  # 6 s is 2% of 300 s: the next save waits 5 minutes
    now[0] += 299.9
    assert not clock.due()
    now[0] += 0.1
    assert clock.due()
    clock.saved(blocked_s=0.1)  # a quick save: back to every 2 minutes
    now[0] += 119.9
    assert not clock.due()
    now[0] += 0.1
    assert clock.due()
    off = loop.SaveClock(0.0, now=lambda: now[0])
    now[0] += 1e9
    assert not off.due()


def test_a_run_without_workdir_prints_the_command_that_continues_it(tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    monkeypatch.chdir(tmp_path)  # the default workdir, runs/<preset>-<time>, lands here
    monkeypatch.delenv(commandline.UV_RUN, raising=False)  # started by plain python
    flags = ["--config", str(ROOT / "configs" / "tiny.py"), "--config.parallel.runtime=sim",
             "--config.train.sample_chars=0", "--config.train.total_steps=10"]  # fmt: skip
    assert main(flags) == 0
    err = capsys.readouterr().err
    [workdir] = (tmp_path / "runs").iterdir()
    command = err.split("to continue this run after a stop:\n  ")[1].splitlines()[0]
    prog = ["python", "-m", "diloco_jax.train"]
    assert shlex.split(command) == [*prog, *flags, "--workdir", str(workdir.relative_to(tmp_path))]
    assert main(shlex.split(command)[len(prog) :]) == 0  # it continues there: nothing to train
    starts = [json.loads(line) for line in (workdir / "run_record.jsonl").read_text().splitlines()]
    assert [r["step"] for r in starts] == [0, 10]


def test_the_command_of_a_run_names_its_program_as_typed_and_replaces_the_workdir():
    def started(module):  # a __main__ module, as `python -m module` leaves it (None: a script)
        return types.SimpleNamespace(__spec__=module and types.SimpleNamespace(name=module))

    train_py = str(ROOT / "diloco_jax" / "train.py")
    assert commandline.program(train_py, started("diloco_jax.train")) == [
        "python", "-m", "diloco_jax.train"]  # fmt: skip
    sim_main = str(ROOT / "sim" / "__main__.py")
    assert commandline.program(sim_main, started("sim.__main__")) == ["python", "-m", "sim"]
    assert commandline.program("/opt/venv/bin/diloco-train", started(None)) == ["diloco-train"]
    assert commandline.program("/home/u/sim/job.py", started(None)) == [
        "python",
        "/home/u/sim/job.py",
    ]
    assert commandline.program("-c", started(None)) == ["python", "-c"]
    args = ["--workdir", "old", "--config.train.sample_prompt=TWO WORDS", "--workdir=older"]
    assert commandline.rerun(["diloco-train"], args, "runs/x", environ={}) == (
        "diloco-train '--config.train.sample_prompt=TWO WORDS' --workdir runs/x"
    )
    assert commandline.rerun(["diloco-train"], args, environ={}) == (
        "diloco-train " + shlex.join(args))  # fmt: skip


def test_the_command_of_a_run_started_by_uv_run_starts_with_uv_run():
    """Issue 61 finding 6: printed without ``uv run``, the command of a run started by ``uv
    run`` (the README's checkout flow) finds no jax in a shell that has not activated uv's
    environment."""
    under_uv = {commandline.UV_RUN: "1"}
    prog = ["python", "-m", "diloco_jax.train"]
    assert commandline.rerun(prog, ["--config", "tiny"], "runs/x", environ=under_uv) == (
        "uv run python -m diloco_jax.train --config tiny --workdir runs/x")  # fmt: skip
    assert commandline.rerun(prog, ["--config", "tiny"], "runs/x", environ={}) == (
        "python -m diloco_jax.train --config tiny --workdir runs/x")  # fmt: skip
    # a command typed as uv run already is not prefixed twice
    assert commandline.rerun(["uv", "run", "diloco-train"], [], environ=under_uv) == (
        "uv run diloco-train")  # fmt: skip


def test_a_stopped_run_names_the_step_of_its_last_evaluation_and_times_its_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """A stop after step 15: the done event says the evaluation it reports is step 10's, and
    the checkpoint written at the stop counts in the time line."""
    asked = []

    def agree_to_stop(stop):  # a SIGTERM that arrives during the call that ends at step 15
        asked.append(1)
        if len(asked) == 4:
            stop.requested = "SIGTERM"
        return stop.requested is not None

    monkeypatch.setattr(loop, "agree_to_stop", agree_to_stop)
    monkeypatch.delenv(commandline.UV_RUN, raising=False)  # started by plain python
    flags = ["--config", "configs/tiny.py", "--workdir", str(tmp_path), "--distributed", "off",
             "--config.parallel.runtime=sim", "--config.train.checkpoint_every=0"]  # fmt: skip
    assert main(flags) == 0
    out = capsys.readouterr().out
    [done] = events(tmp_path, "done")
    evals = {e["step"]: e["eval_loss"] for e in events(tmp_path, "eval")}
    assert (done["steps"], done["eval_step"]) == (15, 10)
    assert done["final_eval_loss"] == evals[10]
    assert done["phases"]["checkpoint"] > 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["15"]
    assert f"stopped by SIGTERM at step 15; last evaluation {evals[10]:.4f} at step 10" in out
    again = shlex.join(["python", "-m", "diloco_jax.train", *flags[:2], *flags[4:],
                        "--workdir", str(tmp_path)])  # fmt: skip
    assert out.rstrip().endswith(f"to continue:\n  {again}")


def test_a_changed_outer_optimizer_is_refused_in_one_line_or_restarts_its_state(finished, capsys):
    shutil.rmtree(finished / "checkpoints" / "20")  # resumed from step 10
    adam = tiny(**{"outer.optimizer": "adam", "outer.learning_rate": 0.01})
    with pytest.raises(config_lib.ConfigError,
                       match=r"^config key outer.optimizer = 'adam' differs from the checkpoint's "
                       r"'sgd' .*allow_config_change=True"):  # fmt: skip
        train(adam, finished, show_progress=False)
    at_10 = checkpoint.restore(checkpoint.manager(finished), build(tiny()).state, 10)
    s = build(adam)
    start = resume.resume(checkpoint.manager(finished), s, finished, allow_config_change=True)
    said = "with another outer optimizer (outer.optimizer 'sgd' -> 'adam'"
    assert said in capsys.readouterr().err
    assert start.step == 10
    for name in ("step", "params", "inner_state", "anchor"):
        assert_bitwise_equal(getattr(start.state, name), getattr(at_10, name))
    assert_bitwise_equal(start.state.outer_state, s.state.outer_state)  # Adam's, as it starts
    assert len(jax.tree.leaves(s.state.outer_state)) > len(jax.tree.leaves(at_10.outer_state))
    summary = train(adam, finished, show_progress=False, allow_config_change=True)
    assert summary["steps"] == 20 and np.isfinite(summary["final_eval_loss"])


@pytest.mark.slow  # 40 s; stand-ins: the saves by time, the printed command, a middle resume
def test_a_run_killed_outright_continues_from_its_last_save_by_time_with_the_printed_command(
    tmp_path,
):
    """SIGKILL (nothing runs at the end: no save, no last line) of a run started without
    --workdir; the command it printed as it started continues it from its last save by time, to
    the bits of a run never killed."""
    over = {"train.total_steps": 400, "train.eval_every": 400, "train.sample_chars": 0,
            "train.checkpoint_minutes": 0.002, "parallel.runtime": "sim"}  # fmt: skip
    cmd = [sys.executable, "-m", "diloco_jax.train", "--config", str(ROOT / "configs" / "tiny.py"),
           *[f"--config.{k}={v}" for k, v in over.items()]]  # fmt: skip
    plain = {k: v for k, v in os.environ.items() if k != commandline.UV_RUN}  # not uv run's
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=plain)  # fmt: skip
    deadline = time.time() + 120

    def saved():  # complete saves: orbax renames a finished one to its step
        return [int(p.name) for p in tmp_path.glob("runs/*/checkpoints/*") if p.name.isdigit()]

    while time.time() < deadline and not any(step >= 50 for step in saved()):
        time.sleep(0.02)
    proc.kill()
    _, err = proc.communicate(timeout=60)
    last = max(saved())
    assert 50 <= last < 400, "the run ended before it was killed: give it more steps"
    command = err.split("to continue this run after a stop:\n  ")[1].splitlines()[0]
    again = shlex.split(command)
    assert again[:3] == ["python", "-m", "diloco_jax.train"]
    resumed = subprocess.run([sys.executable, *again[1:]], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    [workdir] = (tmp_path / "runs").iterdir()
    assert history(workdir)[-1]["step"] >= last  # from the newest save
    cfg = tiny(**over, **{"train.checkpoint_every": 0})
    full = train(cfg, tmp_path / "full", show_progress=False)["state"]
    restored = checkpoint.restore(checkpoint.manager(workdir), build(cfg).state, 400)
    assert_bitwise_equal(restored, full)


def test_an_outer_state_that_cannot_be_rebuilt_is_one_clear_line(tmp_path):
    """Eager outer steps keep one outer state per replica: another optimizer is refused in one
    line. An outer state of other shapes with no outer.* key changed (streaming fragments) is
    the mismatch it is, naming the shapes."""
    eager = {"outer.mode": "eager", "train.checkpoint_every": 20}
    train(tiny(**eager), tmp_path / "e", show_progress=False)
    adam = tiny(**eager, **{"outer.optimizer": "adam", "outer.learning_rate": 0.01})
    with pytest.raises(CheckpointError, match="outer.mode=eager every replica has its own state"):
        train(adam, tmp_path / "e", show_progress=False, allow_config_change=True)
    ten = {"outer.sync_every": 10, "train.checkpoint_every": 20, "model.num_layers": 2}
    train(tiny(**ten, **{"streaming.fragments": 2}), tmp_path / "f", show_progress=False)
    with pytest.raises(CheckpointError, match=r"does not match this run: .*outer_state/"):
        train(tiny(**ten), tmp_path / "f", show_progress=False, allow_config_change=True)
