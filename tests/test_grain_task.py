"""A user's task on grain pipelines (issue 27): each replica reads its own batches, a resume
reads exactly what an uninterrupted run reads (the iterators' states ride in the checkpoint),
the mesh trains what the simulator trains, and bad pipelines are one-line errors."""

import pathlib
import re
import shutil
import subprocess
import sys
import time

import chex
import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diloco_jax
from diloco_jax.tasks import GrainTask, TaskError, replica_batches
from diloco_jax.tasks.pipeline import PipelineStream
from tests.helpers import child_env, died_after
from tests.test_checkpoint import assert_bitwise_equal
from tests.test_user_task import ROOT, TINY  # the same small runs as ArrayTask's tests

X_NxD = np.random.default_rng(0).normal(size=(256, 3)).astype(np.float32)
Y_N = X_NxD @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3
EXAMPLES = [{"x": x, "y": y} for x, y in zip(X_NxD, Y_N, strict=True)]


def loss(params, batch, rng):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def map_pipeline(*, replica, replicas, batch_size, seed):
    return replica_batches(grain.MapDataset.source(EXAMPLES), replica=replica,
                           replicas=replicas, batch_size=batch_size, seed=seed)  # fmt: skip


def iter_pipeline(*, replica, replicas, batch_size, seed):
    """An IterDataset with a filter: its state is not a function of the step alone."""
    ds = grain.MapDataset.source(EXAMPLES)[replica::replicas].shuffle(seed=seed).repeat()
    return ds.to_iter_dataset().filter(lambda e: e["y"] > -3).batch(batch_size)


def loader_pipeline(*, replica, replicas, batch_size, seed):
    import grain.python as gp

    sampler = gp.IndexSampler(len(EXAMPLES), shard_options=gp.ShardOptions(replica, replicas),
                              shuffle=True, num_epochs=None, seed=seed)  # fmt: skip
    return gp.DataLoader(data_source=EXAMPLES, sampler=sampler,
                         operations=[gp.Batch(batch_size, drop_remainder=True)],
                         worker_count=0)  # fmt: skip


def task(pipeline=map_pipeline, **kwargs) -> GrainTask:
    params = {"w": np.zeros(3, np.float32), "b": np.zeros((), np.float32)}
    return GrainTask(params, loss, pipeline, eval_data={"x": X_NxD, "y": Y_N}, **kwargs)


def _calls(stream: PipelineStream, first: int, count: int, sharding) -> list:
    shardings = jax.tree.map(lambda _: sharding, stream.spec)
    return [jax.device_get(stream.on_devices(first + i * stream.num_steps, shardings))
            for i in range(count)]  # fmt: skip


@pytest.mark.parametrize("pipeline", [map_pipeline, iter_pipeline, loader_pipeline],
                         ids=["MapDataset", "IterDataset", "DataLoader"])  # fmt: skip
def test_a_restored_stream_reads_what_the_uninterrupted_one_reads(pipeline):
    """Three calls of 4 steps from one stream; a second stream restored from the first one's
    states after its first call reads the same second and third calls; each replica's batches
    are its own pipeline's, in order."""
    problem = task(pipeline).problem(replicas=3, batch_size=5, seed=7)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    full = problem.stream(num_steps=4)
    calls = _calls(full, 0, 3, one)
    assert calls[0]["x"].shape == (4, 3, 5, 3)
    it = iter(pipeline(replica=1, replicas=3, batch_size=5, seed=7))
    by_hand = np.stack([next(it)["x"] for _ in range(12)])
    np.testing.assert_array_equal(np.concatenate([c["x"][:, 1] for c in calls]), by_hand)
    # the same call again (several devices hold one replica) is read once
    chex.assert_trees_all_equal(_calls(full, 8, 1, one)[0], calls[2])

    cut = problem.stream(num_steps=4)
    _calls(cut, 0, 1, one)
    saved = cut.states()
    resumed = problem.stream(num_steps=4)
    resumed.restore(saved, 4)
    chex.assert_trees_all_equal(_calls(resumed, 4, 2, one), calls[1:])
    with pytest.raises(RuntimeError, match="stand at step 12, not 4"):
        _calls(resumed, 4, 1, one)


def test_fit_on_a_pipeline_learns_and_resumes_bitwise(tmp_path, monkeypatch):
    """20 steps; the same run cut after step 10 (its last checkpoint lost) and resumed ends
    with the same state, bitwise: the resumed pipelines read the batches of steps 11-20."""
    full = diloco_jax.fit(task(iter_pipeline), "tiny", workdir=tmp_path / "full",
                          overrides=TINY, show_progress=False)  # fmt: skip
    assert full.eval_loss < 0.5 * float(np.mean(Y_N**2))  # it learned
    died_after(tmp_path / "full", 10, tmp_path / "cut")
    resumed = diloco_jax.fit(task(iter_pipeline), "tiny", workdir=tmp_path / "cut",
                             overrides=TINY, show_progress=False)  # fmt: skip
    assert resumed.summary["steps"] == 20
    assert_bitwise_equal(resumed.summary["state"], full.summary["state"])
    # the check fails a resume that drops the saved states (steps 1-10's batches read again)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "20")
    restore = PipelineStream.restore
    monkeypatch.setattr(PipelineStream, "restore", lambda self, states, step:
                        restore(self, None, step))  # fmt: skip
    forgetful = diloco_jax.fit(task(iter_pipeline), "tiny", workdir=tmp_path / "cut",
                               overrides=TINY, show_progress=False)  # fmt: skip
    with pytest.raises(AssertionError):
        assert_bitwise_equal(forgetful.summary["state"], full.summary["state"])


@pytest.mark.parametrize("overrides", [
    {"parallel.runtime": "mesh", "parallel.replica_devices": 2, "parallel.data_devices": 2},
    {"sim.chunk": 2, "sim.offload": True},
], ids=["2x2 mesh", "chunks of 2, offloaded"])  # fmt: skip
def test_a_pipeline_task_trains_on_every_layout_what_the_simulator_trains(tmp_path, overrides):
    common = {**TINY, "train.checkpoint": False}
    want = diloco_jax.fit(task(), "tiny", workdir=tmp_path / "a", overrides=common,
                          show_progress=False)  # fmt: skip
    got = diloco_jax.fit(task(), "tiny", workdir=tmp_path / "b",
                         overrides={**common, **overrides}, show_progress=False)  # fmt: skip
    # the data axis averages two half-batch means; chunks round a matmul per vmap size
    chex.assert_trees_all_close(got.params, want.params, rtol=1e-5, atol=1e-6)


def _shifting(*, replica, replicas, batch_size, seed):
    """Replica 1's batches grow a column at its third batch."""
    width = lambda i: 4 if replica == 1 and i >= 2 else 3  # noqa: E731
    return grain.MapDataset.range(10**6).map(
        lambda i: {"x": np.ones((batch_size, width(i)), np.float32),
                   "y": np.ones(batch_size, np.float32)})  # fmt: skip


def _failing(*, replica, replicas, batch_size, seed):
    raise OSError("no such bucket")


def _finite(*, replica, replicas, batch_size, seed):
    return map_pipeline(replica=replica, replicas=replicas, batch_size=batch_size,
                        seed=seed)[:3]  # fmt: skip


@pytest.mark.parametrize("pipeline,message", [
    (3, r"pipeline must be a function \(replica=, replicas=, batch_size=, seed=\)"),
    (_failing, r"pipeline _failing \(.*test_grain_task.py:\d+\) fails for replica 0: OSError: "
               "no such bucket"),
    (lambda **kw: [np.zeros(4)], r"returned list, whose iterator has no get_state/set_state"),
    (lambda **kw: grain.MapDataset.range(99).batch(3), r"gives batches whose arrays have "
     r"\{'the batch': 3\} rows, not data.batch_size = 4"),
    (lambda **kw: replica_batches(grain.MapDataset.range(5), **kw), r"the dataset has 5 "
     r"examples, fewer than 2 replicas x data.batch_size 4"),
], ids=["not callable", "raises", "a list", "other batch size", "too few"])  # fmt: skip
def test_bad_pipelines_are_one_line_errors_before_compiling(pipeline, message):
    with pytest.raises(TaskError, match=message) as info:
        task(pipeline).problem(replicas=2, batch_size=4)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("pipeline,message", [
    (_shifting, r"the pipeline's batch for replica 1 at step 2 is \{'x': 'float32\[4, 4\]', "
                r"'y': 'float32\[4\]'\}, not \{'x': 'float32\[4, 3\]'"),
    (_finite, r"the pipeline of replica 0 ended after 3 batches: repeat it"),
], ids=["shapes change", "runs out"])  # fmt: skip
def test_batches_that_change_or_run_out_are_one_line_errors(pipeline, message):
    stream = task(pipeline).problem(replicas=2, batch_size=4).stream(num_steps=5)
    with pytest.raises(TaskError, match=message) as info:
        _calls(stream, 0, 1, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert "\n" not in str(info.value)


def _example(tmp_path, workdir: str, steps: int) -> subprocess.Popen:
    # not the suite's 8 devices: the example's own default layout; the later runs load their step
    env = child_env(TQDM_DISABLE="1", PYTHONPATH=str(ROOT),
                    DILOCO_COMPILE_CACHE=str(tmp_path / "cache"))  # fmt: skip
    return subprocess.Popen([sys.executable, str(ROOT / "examples" / "llama_grain.py"),
                             "--steps", str(steps), "--workdir", workdir], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _finished(run: subprocess.Popen) -> str:
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    return out + err


def _params(path: pathlib.Path):
    from diloco_jax.runtime import checkpoint

    like = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), _llama_shapes())
    return jax.device_get(checkpoint.load_params(path, like))


def _llama_shapes():
    import importlib.util

    from flax import nnx

    spec = importlib.util.spec_from_file_location("llama_grain", ROOT / "examples" /
                                                  "llama_grain.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    state = nnx.state(nnx.eval_shape(lambda: module.Llama(nnx.Rngs(0))), nnx.Param)
    return nnx.to_pure_dict(state)


@pytest.mark.slow  # ~115 s: three runs; by default a pipeline resumes bitwise in-process
# (test_fit_on_a_pipeline_learns_and_resumes_bitwise) and two examples run from outside
def test_the_llama_example_killed_and_run_again_ends_as_an_uninterrupted_run(tmp_path):
    """From outside the repository: the Llama-style decoder on the shipped text through grain,
    30 steps (checkpoints every 10). One run goes through; another is killed (SIGKILL) once
    its step-10 checkpoint exists, then run again: it resumes from that checkpoint, its
    pipelines where they were, and ends with the same parameters, bitwise."""
    whole = _finished(_example(tmp_path, "whole", 30))
    assert "eval loss" in whole and "after 30 steps" in whole
    killed = _example(tmp_path, "killed", 30)
    deadline = time.time() + 240
    while not (tmp_path / "killed" / "checkpoints" / "10").is_dir():
        assert killed.poll() is None and time.time() < deadline, killed.stderr.read()[-3000:]
        time.sleep(0.05)
    killed.kill()
    killed.communicate()
    assert not (tmp_path / "killed" / "params").exists()  # it did not get to the end
    again = _finished(_example(tmp_path, "killed", 30))
    resumed = re.search(r"resumed from .* at step (\d+)", again)
    assert resumed and int(resumed.group(1)) in (10, 20), again[-3000:]
    chex.assert_trees_all_equal(_params(tmp_path / "killed" / "params"),
                                _params(tmp_path / "whole" / "params"))  # fmt: skip


GRAIN_MODULE = """
import grain
import jax.numpy as jnp
import numpy as np
from diloco_jax import GrainTask, replica_batches

x = np.random.default_rng(0).normal(size=(256, 3)).astype(np.float32)
examples = [{"x": a, "y": a @ np.array([1.0, -2.0, 0.5], np.float32)} for a in x]


def pipeline(*, replica, replicas, batch_size, seed):
    ds = grain.MapDataset.source(examples)[replica::replicas].shuffle(seed=seed).repeat()
    return ds.to_iter_dataset().filter(lambda e: e["y"] > -3).batch(batch_size)


def make():
    def loss(params, batch, rng):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    eval_data = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)}
    return GrainTask({"w": np.zeros(3, np.float32)}, loss, pipeline, eval_data)
"""


@pytest.mark.slow  # ~60 s: three launcher runs
def test_two_processes_cut_and_resumed_by_one_read_what_one_process_reads(tmp_path):
    """The launcher's 2 processes (1 device each, each reading its own replica's pipeline)
    stop after step 10 (their step-20 checkpoint lost); 1 process with 2 devices resumes them
    from the checkpoint's pipeline states, both processes' merged, and ends where 1 process
    running throughout ends, bitwise."""
    from diloco_jax.runtime import checkpoint

    (tmp_path / "mytask.py").write_text(GRAIN_MODULE)
    flags = [
        "--config",
        "tiny",
        "--config.train.sample_chars=0",
        "--config.parallel.runtime=mesh",
        "--config.parallel.replicas=2",
        "--config.train.checkpoint_every=10",
        "--config.task.factory=mytask:make",
    ]
    env = child_env(TQDM_DISABLE="1", PYTHONPATH=str(ROOT))  # the launcher gives the devices

    def launch(workdir, processes, devices):
        run = subprocess.run([sys.executable, "-m", "diloco_jax.launch", "-n", str(processes),
                              "--devices_per_process", str(devices), "--", *flags,
                              "--workdir", workdir], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stderr

    launch("one", 1, 2)
    launch("cut", 2, 1)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "20")
    shutil.rmtree(tmp_path / "cut" / "params")
    assert "resumed from" in launch("cut", 1, 2)
    like = {"w": jnp.zeros(3, jnp.float32)}
    one, cut = (jax.device_get(checkpoint.load_params(tmp_path / name / "params", like))
                for name in ("one", "cut"))  # fmt: skip
    chex.assert_trees_all_equal(cut, one)
    assert float(np.abs(one["w"]).max()) > 0.01  # it trained
