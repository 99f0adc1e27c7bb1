"""Checkpoints: exact continuation, fallback from a corrupt latest one, clear mismatch errors,
graceful stop on SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from diloco_jax import checkpoint
from diloco_jax.checkpoint import CheckpointError
from diloco_jax.config import apply_overrides, load_preset
from diloco_jax.train import train


def tiny(**overrides):
    base = {"parallel.runtime": "sim", "train.sample_chars": 0, "train.checkpoint_every": 10}
    items = {**base, **overrides}.items()
    return apply_overrides(load_preset("configs/tiny.py"), [(k, str(v)) for k, v in items])


def assert_bitwise_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return train(tiny(), tmp_path_factory.mktemp("full"), show_progress=False)["state"]


def test_resume_from_a_middle_checkpoint_is_bitwise_identical(uninterrupted, tmp_path):
    train(tiny(), tmp_path, show_progress=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["10", "20"]
    # as if the run had died after its step-10 checkpoint
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "20")
    resumed = train(tiny(), tmp_path, show_progress=False)
    assert resumed["steps"] == 20
    assert_bitwise_equal(resumed["state"], uninterrupted)


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
    done = [json.loads(x) for x in metrics.read_text().splitlines() if '"done"' in x]
    assert done[-1]["preempted"] == "SIGTERM"
    cfg = tiny(**{"train.checkpoint_every": 0, **over})
    resumed = train(cfg, workdir, show_progress=False)
    full = train(cfg, tmp_path / "full", show_progress=False)
    assert_bitwise_equal(resumed["state"], full["state"])


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
    cfg = tiny(**{"parallel.replicas": resumed, "train.total_steps": 30})
    from diloco_jax.resume import resume
    from diloco_jax.train import build

    s = build(cfg)
    mngr = checkpoint.manager(tmp_path)
    state = jax.device_get(resume(mngr, s, tmp_path))
    assert "elastic restart at step 20" in capsys.readouterr().err
    assert int(state.step) == 20 and int(state.step) == 20
    assert_bitwise_equal(state.anchor, first.anchor)
    assert_bitwise_equal(state.outer_state, first.outer_state)
    for leaf, a in zip(jax.tree.leaves(state.params), jax.tree.leaves(first.anchor),
                       strict=True):  # fmt: skip
        assert leaf.shape[0] == resumed
        np.testing.assert_array_equal(leaf, np.broadcast_to(a, leaf.shape))
    # and the run goes on from there
    summary = train(cfg, tmp_path, show_progress=False)
    assert summary["steps"] == 30 and np.isfinite(summary["final_eval_loss"])
