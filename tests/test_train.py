"""End to end: ``train`` on the tiny preset writes what it promises, for every algorithm."""

import json

import chex
import jax
import numpy as np
import pytest

from diloco_jax.config import apply_overrides, load_preset
from diloco_jax.run.setup import build
from diloco_jax.runtime import checkpoint
from diloco_jax.tasks import model
from diloco_jax.tasks.sample import generate_text
from diloco_jax.train import train
from tests import helpers
from tests.helpers import BAR, run_records, tb_hparams, tb_series, tf_events


def tiny(**overrides):
    return apply_overrides(
        load_preset("configs/tiny.py"), [(k, str(v)) for k, v in overrides.items()]
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tiny")
    with helpers.drawing_figures():
        return workdir, train(tiny(**{"parallel.runtime": "sim"}), workdir, show_progress=False)


def test_outputs(tiny_run):
    workdir, summary = tiny_run
    events = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [10, 20]
    assert all(np.isfinite(e["eval_loss"]) for e in evals)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < np.log(256)  # it learns
    assert evals[-1]["outer_steps"] == 4
    assert summary["final_eval_loss"] == evals[-1]["eval_loss"]
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((workdir / "config.json").read_text())["outer"]["sync_every"] == 5
    assert (workdir / "checkpoints" / "20").is_dir()
    assert (workdir / "drift.png").stat().st_size > 0 and (workdir / "cosine.png").exists()
    assert summary["sample"].startswith("ROMEO.\n") and len(summary["sample"]) >= 40
    series = tb_series(tf_events(workdir))  # a per-replica value is one series per replica
    [train20] = [e for e in events if (e["event"], e["step"]) == ("train", 20)]
    for r in range(4):
        assert [s for s, _ in series[f"sync/drift/replica_{r}"]] == [5, 10, 15, 20]
        assert series[f"train/replica_loss/replica_{r}"][-1] == (20, pytest.approx(
            train20["replica_loss"][r]))  # fmt: skip
    [hparams] = tb_hparams(tf_events(workdir))
    assert hparams["outer.sync_every"].number_value == 5
    assert hparams["algorithm"].string_value == "diloco" and hparams["log.progress_bar"].bool_value
    [record] = run_records(workdir)
    assert record["step"] == 0 and record["packages"]["jax"] and record["command"]
    assert record["git"] is None or isinstance(record["git"]["dirty"], bool)  # CI: a checkout
    assert (record["devices"]["platform"], record["devices"]["count"]) == ("cpu", 8)
    # where the time went (issue 28): every phase, each within the run's own time
    phases, done = summary["phases"], events[-1]
    assert list(phases) == ["start", "compile", "steps", "eval", "checkpoint", "finish"]
    assert done["event"] == "done" and done["phases"] == phases
    assert all(v >= 0 for v in phases.values()) and phases["steps"] > 0 < phases["compile"]
    assert sum(phases.values()) - phases["start"] <= done["time_s"] + 0.1


def test_checkpoint_restores_the_final_state(tiny_run):
    workdir, summary = tiny_run
    like = build(tiny(**{"parallel.runtime": "sim"})).state
    restored = checkpoint.restore(checkpoint.manager(workdir), like)
    chex.assert_trees_all_equal(jax.device_get(restored), jax.device_get(summary["state"]))


def test_rerun_resumes_and_does_not_retrain(tiny_run, capsys, monkeypatch):
    workdir, summary = tiny_run
    metrics = (workdir / "metrics.jsonl").read_text()
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    capsys.readouterr()
    # show_progress is on: the key turns the bar off (and may change on a resume)
    drawn = (workdir / "drift.png").stat().st_mtime_ns
    again = train(tiny(**{"parallel.runtime": "sim", "log.progress_bar": False,
                          "log.figures": False}), workdir)  # fmt: skip
    assert (workdir / "drift.png").stat().st_mtime_ns == drawn  # not drawn again
    assert BAR not in capsys.readouterr().err
    assert again["steps"] == 20 and again["final_eval_loss"] == pytest.approx(
        summary["final_eval_loss"]
    )
    # the finished run's eval and done events are not written again; the resume is recorded
    assert (workdir / "metrics.jsonl").read_text() == metrics
    [entry] = map(json.loads, (workdir / "config_history.jsonl").read_text().splitlines())
    assert entry["step"] == 20 and entry["changes"] == {
        "log.progress_bar": [True, False],
        "log.figures": [True, False],
    }
    assert [r["step"] for r in run_records(workdir)] == [0, 20]  # one record per start
    assert len(tb_hparams(tf_events(workdir))) == 1  # the first start's only


@pytest.mark.parametrize("algorithm", ["ddp", "single"])
def test_baselines_train(algorithm, tmp_path):
    summary = train(tiny(algorithm=algorithm, **{"train.sample_chars": 0}), tmp_path,
                    show_progress=False)  # fmt: skip
    assert np.isfinite(summary["final_eval_loss"]) and summary["final_eval_loss"] < np.log(256)
    replicas = 1 if algorithm == "single" else 4
    assert summary["state"].params["head"]["kernel"].shape[0] == replicas


@pytest.mark.slow  # ~11 s; mesh == simulator by default in test_parallel
def test_mesh_runtime_trains_like_the_simulator(tiny_run, tmp_path):
    _, sim = tiny_run
    mesh = train(tiny(**{"parallel.runtime": "mesh", "train.sample_chars": 0}), tmp_path,
                 show_progress=False)  # fmt: skip
    assert mesh["final_eval_loss"] == pytest.approx(sim["final_eval_loss"], abs=1e-4)


def test_model_is_causal():
    graphdef, params = model.init_model(0, vocab_size=256, seq_len=8, d_model=16, num_layers=2,
                                        num_heads=2, mlp_ratio=2)  # fmt: skip
    tokens = np.arange(8, dtype=np.int32)[None]
    changed = tokens.copy()
    changed[0, 5] = 99
    apply = jax.jit(lambda tokens: model.apply(graphdef, params, tokens))  # compiled once
    a, b = apply(tokens), apply(changed)
    np.testing.assert_array_equal(a[0, :5], b[0, :5])
    assert not np.allclose(a[0, 5:], b[0, 5:])


def test_generate_text_length_and_prompt():
    graphdef, params = model.init_model(0, vocab_size=256, seq_len=16, d_model=16, num_layers=1,
                                        num_heads=2, mlp_ratio=2)  # fmt: skip
    text = generate_text(graphdef, params, "To be", num_chars=30, seq_len=16, seed=0)
    assert text.startswith("To be")
    assert text == generate_text(graphdef, params, "To be", num_chars=30, seq_len=16, seed=0)
    assert text != generate_text(graphdef, params, "To be", num_chars=30, seq_len=16, seed=1)


def test_only_installed_code_tells_a_users_module_apart(tmp_path):
    """The command skips the interpreter's teardown only when no user module ran in it."""
    import sys
    import types

    from diloco_jax.watch import reporting

    assert not reporting.only_installed_code()  # this test module is loaded, from tests/
    installed = {name: module for name, module in sys.modules.items()
                 if name.split(".")[0] in ("json", "numpy", "jax", "diloco_jax")}  # fmt: skip
    assert reporting.only_installed_code(installed)
    user = types.ModuleType("users_task")
    user.__file__ = str(tmp_path / "users_task.py")
    assert not reporting.only_installed_code({**installed, "users_task": user})
