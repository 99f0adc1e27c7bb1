"""A user's own task (issue 27): ArrayTask's sampling and evaluation, fit() from Python, the
command line's task.factory, exact resume, the mesh against the simulator, the built-in digits
task reproduced through the public interface, and a one-line error for each kind of bad code."""

import json
import os
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_jax
from diloco_jax import tasks
from diloco_jax.config import ConfigError
from diloco_jax.runtime import checkpoint
from diloco_jax.tasks import ArrayTask, TaskError
from tests.helpers import child_env, died_after
from tests.test_checkpoint import assert_bitwise_equal

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = {
    "parallel.runtime": "sim",
    "train.sample_chars": 0,
    "train.checkpoint_every": 10,
    "inner.learning_rate": 0.05,
}


def linear_task(n=256, **kwargs) -> ArrayTask:
    """Least squares with a plain params dict (no framework): y = x @ w_true + b_true."""
    rng = np.random.default_rng(0)
    x_NxD = rng.normal(size=(n, 3)).astype(np.float32)
    y_N = x_NxD @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3

    def loss(params, batch, rng):
        pred_B = batch["x"] @ params["w"] + params["b"]
        return jnp.mean((pred_B - batch["y"]) ** 2)

    params = {"w": np.zeros(3, np.float32), "b": np.zeros((), np.float32)}
    return ArrayTask(params, loss, {"x": x_NxD, "y": y_N}, **kwargs)


def test_batches_are_drawn_from_each_replicas_own_shard_as_a_pure_function():
    data = {"i": np.arange(100), "x": np.arange(200.0).reshape(100, 2)}
    loss = lambda params, batch, rng: params["w"] * jnp.mean(batch["x"])  # noqa: E731
    problem = ArrayTask({"w": np.float32(1)}, loss, data).problem(replicas=3, batch_size=4)
    assert problem.shards["i"].shape == (3, 33) and problem.shards["x"].shape == (3, 33, 2)
    for r in range(3):
        shard = jax.tree.map(lambda x, r=r: x[r], problem.shards)
        batch = problem.task.sample(shard, seed=0, replica=r, step=5, batch_size=4)
        again = problem.task.sample(shard, seed=0, replica=r, step=5, batch_size=4)
        chex.assert_trees_all_equal(batch, again)
        assert set(np.asarray(batch["i"])) <= set(range(33 * r, 33 * (r + 1)))  # its own shard
        np.testing.assert_array_equal(batch["x"][:, 0], 2.0 * batch["i"])  # rows stay together


def test_the_default_evaluation_is_the_mean_loss_over_every_example():
    task = linear_task(n=300, eval_batch=64)  # 300 = 4 chunks of 64 + 44: padding masked
    problem = task.problem(replicas=2, batch_size=4)
    params = {"w": np.array([1.0, 0.0, 0.0], np.float32), "b": np.float32(0.1)}
    got = problem.task.eval_fn(params, problem.eval_data)["eval_loss"]
    data = task.train_data
    want = np.mean((data["x"] @ params["w"] + params["b"] - data["y"]) ** 2)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_fit_learns_and_resumes_bitwise(tmp_path):
    """20 steps (4 replicas, sync_every 5) from Python; the same run cut after step 10 and
    resumed ends with the same state, bitwise; the history holds the evaluations."""
    task = linear_task()
    full = diloco_jax.fit(task, "tiny", workdir=tmp_path / "full", overrides=TINY,
                          show_progress=False)  # fmt: skip
    assert full.eval_loss < 0.5 * float(np.mean(task.train_data["y"] ** 2))  # it learned
    evals = [e for e in full.history if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 10, 20]  # train.eval_at_start: auto, a user task
    mean_square = float(np.mean(task.train_data["y"] ** 2))  # the loss at w = b = 0
    assert evals[0]["eval_loss"] == pytest.approx(mean_square, rel=1e-5)
    chex.assert_trees_all_close(full.params["w"], full.summary["state"].anchor["w"])
    died_after(tmp_path / "full", 10, tmp_path / "cut")
    resumed = diloco_jax.fit(task, "tiny", workdir=tmp_path / "cut", overrides=TINY,
                             show_progress=False)  # fmt: skip
    assert resumed.summary["steps"] == 20
    assert_bitwise_equal(resumed.summary["state"], full.summary["state"])


def test_a_user_task_on_a_2x2_mesh_trains_what_the_simulator_trains(tmp_path):
    """With the user's own optimizers (a clipped AdamW inside, Adam outside: issue 39)."""
    from tests.test_user_optimizers import clipped_adamw, outer_adam

    task, mine = linear_task(), {"inner": clipped_adamw(0.05), "outer": outer_adam(0.3)}
    sim = diloco_jax.fit(task, "tiny", workdir=tmp_path / "sim", show_progress=False,
                         overrides={**TINY, "train.checkpoint": False}, **mine)  # fmt: skip
    mesh = diloco_jax.fit(task, "tiny", workdir=tmp_path / "mesh", show_progress=False,
                          overrides={**TINY, "train.checkpoint": False, "parallel.runtime":
                                     "mesh", "parallel.replica_devices": 2,
                                     "parallel.data_devices": 2}, **mine)  # fmt: skip
    # the same math; XLA sums the batch's halves on two devices (float32 reassociation)
    chex.assert_trees_all_close(mesh.params, sim.params, rtol=1e-5, atol=1e-6)
    assert mesh.eval_loss == pytest.approx(sim.eval_loss, rel=1e-5)


def test_the_digits_through_the_public_interface_train_what_the_built_in_task_trains(tmp_path):
    """The built-in image task is an ArrayTask's sampling and loss: the ResNet on the shipped
    digits as a user would write it trains the same state, bitwise."""
    from diloco_jax.config import problems
    from diloco_jax.data.images import as_float
    from diloco_jax.tasks import vision
    from tests.test_checkpoint import tiny

    cfg = tiny(
        **{
            "data.corpus": "digits",
            "data.batch_size": 8,
            "train.checkpoint": False,
            "resnet.width": 4,
            "resnet.stages": 1,
        }
    )  # the smallest ResNet: its compile
    built_in = problems.load(cfg, 4)
    images_RxS, labels_RxS = built_in.shards

    def loss(params, batch, rng):
        images_B, labels_B = batch
        logits = vision.apply(built_in.graphdef, params, as_float(images_B))
        return vision.cross_entropy(logits, labels_B).mean()

    flat = (images_RxS.reshape(-1, *images_RxS.shape[2:]), labels_RxS.reshape(-1))
    mine = ArrayTask(built_in.params, loss, flat, eval_data=built_in.eval_data,
                     evaluate=built_in.task.eval_fn)  # fmt: skip
    from diloco_jax.train import train

    want = train(cfg, tmp_path / "built_in", show_progress=False)
    got = train(cfg, tmp_path / "mine", show_progress=False, task=mine)
    assert_bitwise_equal(got["state"], want["state"])
    assert got["final_eval_loss"] == want["final_eval_loss"]


USER_MODULE = """
import jax.numpy as jnp
import numpy as np
from diloco_jax import ArrayTask


def make(n=256, scale=1.0):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = scale * (x @ np.array([1.0, -2.0, 0.5], np.float32))

    def loss(params, batch, rng):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    return ArrayTask({"w": np.zeros(3, np.float32)}, loss, {"x": x, "y": y})


not_a_function = 3
"""


def _train_cli(cwd, *flags):
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "diloco_jax.train", "--config", "tiny",
                           "--config.train.sample_chars=0", "--config.parallel.runtime=sim",
                           *flags], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_the_command_line_trains_a_factory_from_the_working_directory(tmp_path):
    (tmp_path / "mytask.py").write_text(USER_MODULE)
    run = _train_cli(tmp_path, "--workdir", "w", "--config.task.factory=mytask:make",
                     '--config.task.args={"n": 128, "scale": 0.5}')  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "final eval loss" in run.stdout
    config = json.loads((tmp_path / "w" / "config.json").read_text())
    assert config["task"] == {"factory": "mytask:make", "args": '{"n": 128, "scale": 0.5}'}


def test_a_bad_factory_is_one_error_line_before_any_work(tmp_path):
    (tmp_path / "mytask.py").write_text(USER_MODULE)
    run = _train_cli(tmp_path, "--workdir", "w", "--config.task.factory=mytask:missing")
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [
        "error: config key task.factory = 'mytask:missing': mytask has no function 'missing'"
    ]
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("overrides,message", [
    ({"task.factory": "nosuchmodule:make"},
     "task.factory = 'nosuchmodule:make': cannot import nosuchmodule: ModuleNotFoundError"),
    ({"task.factory": "mytask:not_a_function"}, "mytask has no function 'not_a_function'"),
    ({"task.factory": "mytask:make", "task.args": '{"n": 10}'},
     "train_data has 10 examples: 2 per replica for 4 replicas, fewer than data.batch_size"),
    ({"task.factory": "mytask"}, "task.factory = 'mytask' is invalid: must be "
     "package.module:function"),
    ({"task.factory": "mytask:make", "task.args": "[1]"},
     r"task.args = '\[1\]' is invalid: must be a JSON object"),
])  # fmt: skip
def test_bad_factories_are_one_line_errors(tmp_path, monkeypatch, overrides, message):
    """The checks the command line runs (its one error line: the test above), in-process."""
    from diloco_jax.config import problems, validate
    from tests.test_checkpoint import tiny

    cfg = tiny(**overrides)  # the preset's path is the repository's
    (tmp_path / "mytask.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises((ConfigError, TaskError), match=message) as info:
        validate(cfg)
        problems.load(cfg, 4)
    assert "\n" not in str(info.value)


def _bad(name):
    good = linear_task()
    x = good.train_data

    def vector_loss(params, batch, rng):
        return (batch["x"] @ params["w"]) ** 2

    def int_loss(params, batch, rng):
        return jnp.sum(batch["x"] > 0).astype(jnp.int32)

    def broken_loss(params, batch, rng):
        return jnp.mean(batch["x"] @ params["missing"])

    def always_draws(params, batch, rng):  # dropout without a None check
        keep = jax.random.bernoulli(rng, 0.9, batch["x"].shape)
        return jnp.mean((jnp.where(keep, batch["x"], 0) @ params["w"] - batch["y"]) ** 2)

    def no_eval_loss(params, data):
        return {"mse": jnp.float32(0)}

    return {
        "vector loss": (ArrayTask(good.params, vector_loss, x),
                        r"loss .*vector_loss \(.*test_user_task.py:\d+\) must return a float "
                        r"scalar .*float32\[16\]"),
        "int loss": (ArrayTask(good.params, int_loss, x), r"must return a float scalar"),
        "loss raises": (ArrayTask(good.params, broken_loss, x),
                        r"loss .*broken_loss .* fails on a batch of shapes .*KeyError"),
        "ragged data": (ArrayTask(good.params, good.loss, {**x, "y": x["y"][:-1]}),
                        r"train_data's arrays must share their leading \(example\) axis"),
        "too few": (ArrayTask(good.params, good.loss, jax.tree.map(lambda a: a[:40], x)),
                    r"train_data has 40 examples: 10 per replica for 4 replicas, fewer than "
                    r"data.batch_size = 16"),
        "no eval_loss": (ArrayTask(good.params, good.loss, x, evaluate=no_eval_loss),
                         r"must return a dict with a scalar 'eval_loss'; got \{'mse'"),
        "empty data": (ArrayTask(good.params, good.loss, {}), r"train_data holds no arrays"),
        "int params": (ArrayTask({"w": good.params["w"], "head": {"bias": np.int32(0)}},
                                 good.loss, x),
                       r"parameter head/bias is int32: parameters must be floating point"),
        "always draws": (ArrayTask(good.params, always_draws, x),
                         r"the evaluation fails .*PRNG key.*; the default evaluation calls "
                         r"loss\(params, batch, rng=None\)"),
        "init fails": (ArrayTask(lambda key: 1 / 0, good.loss, x),
                       r"init .*<lambda> .* fails on a key: ZeroDivisionError"),
    }[name]  # fmt: skip


@pytest.mark.parametrize("name", ["vector loss", "int loss", "loss raises", "ragged data",
                                  "too few", "no eval_loss", "empty data", "int params",
                                  "always draws", "init fails"])  # fmt: skip
def test_bad_user_code_is_one_line_before_compiling(name):
    task, message = _bad(name)
    with pytest.raises(TaskError, match=message) as info:
        task.problem(replicas=4, batch_size=16)
    assert "\n" not in str(info.value)


def seeded_task(seed: int = 0, n: int = 256) -> ArrayTask:
    """A task factory taking the run's seed (``task.factory`` passes it): its initialisation
    is drawn from it."""
    task = linear_task(n)
    w = np.random.default_rng(seed).normal(size=3).astype(np.float32)
    return ArrayTask({"w": w, "b": np.float32(0)}, task.loss, task.train_data)


def test_the_runs_seed_reaches_the_users_initialisation():
    """``ArrayTask(init(key), ...)`` and a factory with a ``seed`` argument: the run's seed
    sets the parameters (a seed sweep varies them); the same seed, the same parameters."""
    task = linear_task()
    init = ArrayTask(lambda key: {"w": jax.random.normal(key, (3,)), "b": jnp.float32(0)},
                     task.loss, task.train_data)  # fmt: skip
    one, again, other = (init.problem(4, 16, seed=s).params["w"] for s in (1, 1, 2))
    np.testing.assert_array_equal(one, again)
    assert not np.array_equal(one, other)
    assert init.fingerprint() == init.fingerprint()

    from diloco_jax.config import problems

    factory = "tests.test_user_task:seeded_task"
    made = [problems.user_task(factory, args, seed=s).params["w"]
            for s, args in ((1, ""), (2, ""), (2, '{"seed": 1}'))]  # fmt: skip
    assert not np.array_equal(made[0], made[1])
    np.testing.assert_array_equal(made[0], made[2])  # args given win


def _with_mae(params, data):
    pred_N = data["x"] @ params["w"] + params["b"]
    return {"eval_loss": jnp.mean((pred_N - data["y"]) ** 2),
            "mae": jnp.mean(jnp.abs(pred_N - data["y"]))}  # fmt: skip


def test_a_python_sweep_reuses_finished_runs_of_the_same_task_only(tmp_path):
    """Two seeds of two settings of a task whose evaluation also returns ``mae`` and whose
    initialisation takes the seed: the tables hold every value the evaluation returns, with
    its spread over seeds, and the figures plot the chosen one with a band."""
    base = linear_task()
    task = ArrayTask(lambda key: {"w": jax.random.normal(key, (3,)), "b": jnp.float32(0)},
                     base.loss, base.train_data, evaluate=_with_mae)  # fmt: skip
    kwargs = dict(workdir=tmp_path, sweeps=["outer.sync_every=5,10"], show_progress=False,
                  seeds=[0, 1], overrides={**TINY, "train.checkpoint": False,
                                           "sim.plot_metric": "mae"})  # fmt: skip
    table = diloco_jax.sweep(task, "tiny", **kwargs)
    assert [row["run"] for row in table] == ["sync_every=5", "sync_every=10"]
    assert all(row["seeds"] == 2 and row["final_mae_std"] > 0 for row in table)
    results = (tmp_path / "results.csv").read_text().splitlines()
    assert "final_mae" in results[0].split(",") and len(results) == 5
    assert "final_mae_std" in (tmp_path / "summary.csv").read_text().splitlines()[0]
    if (tmp_path / "curves.png").exists():  # with matplotlib (the plots extra)
        assert (tmp_path / "tradeoff.png").stat().st_size > 0
    summary = next((tmp_path / "runs").glob("sync_every=5*")) / "summary.json"
    written = summary.stat().st_mtime_ns
    assert diloco_jax.sweep(task, "tiny", **kwargs) == table
    assert summary.stat().st_mtime_ns == written  # read back, not trained again
    changed = ArrayTask(task.params, task.loss, jax.tree.map(lambda x: x * 2, task.train_data),
                        evaluate=_with_mae)  # fmt: skip
    with pytest.raises(ConfigError, match="with another config or task"):
        diloco_jax.sweep(changed, "tiny", **kwargs)
    with pytest.raises(ConfigError, match="with another config or task"):  # another optimizer
        diloco_jax.sweep(task, "tiny", **kwargs, inner=optax.adamw(1e-2))


def test_fit_refuses_a_bad_override_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'outer.sync_evry'"):
        diloco_jax.fit(linear_task(), workdir=tmp_path, overrides={"outer.sync_evry": 5})
    assert not any(tmp_path.iterdir())


def test_the_nnx_example_runs_from_outside_the_repository(tmp_path):
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "nnx_mlp.py"), "100", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = run.stdout.strip().splitlines()
    assert rows[0].startswith("sync_every | eval MSE")
    assert [r.split("|")[0].strip() for r in rows[1:]] == ["10", "50"]
    # below predicting 0 (the targets' variance, 0.24); the seeds differ (their own MLPs)
    means, spreads = zip(*(map(float, r.split("|")[1].split("±")) for r in rows[1:]), strict=True)
    assert all(m < 0.24 for m in means) and all(s > 0 for s in spreads)
    runs = tmp_path / "runs" / "nnx_mlp" / "runs"
    assert (runs / "sync_every=10,seed=1" / "checkpoints").is_dir()
    assert '"optimizer": "given:' in (runs / "sync_every=10,seed=1" / "config.json").read_text()
    assert (tmp_path / "runs" / "nnx_mlp" / "summary.csv").is_file()


def test_tasks_exports_the_public_interface():
    assert {"ArrayTask", "Problem", "Task", "TaskError"} <= set(tasks.__all__)
    assert diloco_jax.ArrayTask is ArrayTask and callable(diloco_jax.fit)


@pytest.mark.slow  # ~28 s; stand-ins: the in-process user task on a 2x2 mesh above and the
# NNX example from outside the repository
def test_the_linen_example_trains_on_a_2x2_mesh_from_outside_the_repository(tmp_path):
    env = child_env(TQDM_DISABLE="1", PYTHONPATH=str(ROOT))  # the example splits the CPU itself
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "linen_cnn_digits.py"), "40"],
                         cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 replicas on mesh (2 replica x 2 data devices" in run.stderr
    loss, accuracy = (float(w.rstrip(",")) for w in run.stdout.split()[2::2])
    assert loss < np.log(10) and accuracy > 0.2  # learning from chance (2.30 nats, 0.1)
    assert (tmp_path / "runs" / "linen_cnn_digits" / "checkpoints" / "40").is_dir()


@pytest.mark.parametrize("overrides", [
    {"sim.chunk": 2, "sim.offload": True},
    {"parallel.runtime": "mesh", "parallel.replica_devices": 2, "parallel.data_devices": 2,
     "parallel.fsdp": True},
], ids=["chunks of 2, offloaded", "FSDP on 2x2"])  # fmt: skip
def test_a_user_task_in_chunks_and_with_fsdp_trains_what_the_simulator_trains(tmp_path, overrides):
    task = linear_task()
    common = {**TINY, "train.checkpoint": False}
    want = diloco_jax.fit(task, "tiny", workdir=tmp_path / "a", overrides=common,
                          show_progress=False)  # fmt: skip
    got = diloco_jax.fit(task, "tiny", workdir=tmp_path / "b", overrides={**common, **overrides},
                         show_progress=False)  # fmt: skip
    # chunks: bitwise in principle, but a 16-row matmul's gradient rounds per vmap size;
    # FSDP: the data axis's mean in another order (float32 reassociation)
    chex.assert_trees_all_close(got.params, want.params, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~35 s; the default suite keeps a user task on a 2x2 mesh, in chunks, FSDP
def test_two_processes_train_a_factory_as_one_process_does(tmp_path):
    """The launcher's 2 processes (1 device each) import the factory from their working
    directory and train what 1 process with 2 devices trains, bitwise (the same programs)."""
    (tmp_path / "mytask.py").write_text(USER_MODULE)
    flags = ["--config", "tiny", "--config.train.sample_chars=0",
             "--config.parallel.runtime=mesh", "--config.parallel.replicas=2",
             "--config.task.factory=mytask:make"]  # fmt: skip
    env = child_env(TQDM_DISABLE="1", PYTHONPATH=str(ROOT))  # the launcher gives the devices
    finals = {}
    for name, processes, devices in (("two", 2, 1), ("one", 1, 2)):
        run = subprocess.run([sys.executable, "-m", "diloco_jax.launch", "-n", str(processes),
                              "--devices_per_process", str(devices), "--", *flags,
                              "--workdir", name], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        like = {"w": jnp.zeros(3, jnp.float32)}  # on this process's device
        finals[name] = jax.device_get(checkpoint.load_params(tmp_path / name / "params", like))
    chex.assert_trees_all_equal(finals["two"], finals["one"])
    assert float(np.abs(finals["two"]["w"]).max()) > 0.01  # it trained


def test_a_losss_auxiliary_metrics_reach_the_train_events_on_every_layout(tmp_path):
    """A loss returning ``(loss, {"mae": ...})``: each train event carries ``aux_mae``, the
    replicas' mean at the call's last step, the same (to rounding) on a 2x2 mesh, whose data
    axis averages the two halves of each batch as it does the loss."""
    base = linear_task()

    def loss(params, batch, rng):
        err_B = batch["x"] @ params["w"] + params["b"] - batch["y"]
        return jnp.mean(err_B**2), {"mae": jnp.mean(jnp.abs(err_B))}

    task = ArrayTask(base.params, loss, base.train_data)
    common = {**TINY, "train.checkpoint": False}
    mesh_keys = {"parallel.runtime": "mesh", "parallel.replica_devices": 2,
                 "parallel.data_devices": 2}  # fmt: skip
    runs = [diloco_jax.fit(task, "tiny", workdir=tmp_path / name, show_progress=False,
                           overrides={**common, **extra})
            for name, extra in (("sim", {}), ("mesh", mesh_keys))]  # fmt: skip
    series = [[e["aux_mae"] for e in run.history if e["event"] == "train"] for run in runs]
    assert len(series[0]) == 4 and series[0][-1] < series[0][0]  # every 5 steps; it learns
    np.testing.assert_allclose(series[1], series[0], rtol=1e-5)
    sync = next(e for e in runs[0].history if e["event"] == "sync")
    assert "aux" not in sync and "aux_mae" not in sync
    # the evaluation is the mean of the loss itself, not of its metrics
    assert runs[0].eval_loss == pytest.approx(
        float(np.mean((base.train_data["x"] @ runs[0].params["w"] + runs[0].params["b"]
                       - base.train_data["y"]) ** 2)), rel=1e-4)  # fmt: skip
