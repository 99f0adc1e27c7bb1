"""The evaluation split over the devices (issue 28): each device evaluates a block of the
examples, the blocks' means combined on the host; the same values as one device evaluating
every example, to float32 rounding, and the same on every layout of the same devices."""

import contextlib

import jax
import numpy as np
import pytest
from jax._src import dispatch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.config import problems
from diloco_jax.run.setup import build
from diloco_jax.runtime import evaluation
from tests.test_checkpoint import tiny


def _replicated(params, devices):
    mesh = Mesh(np.asarray(devices), ("d",))
    return jax.device_put(params, NamedSharding(mesh, P()))


@pytest.fixture(scope="module")
def lm():
    return problems.load(tiny(), replicas=1)


@pytest.mark.parametrize("count", [2, 3, 8], ids=["2 devices", "3 (uneven blocks)", "8"])
def test_blocks_on_several_devices_give_the_whole_evaluation(lm, count):
    devices = jax.devices()[:count]
    whole = {k: float(v) for k, v in lm.task.eval_fn(lm.params, lm.eval_data).items()}
    placed = evaluation.place(lm.eval_data, devices)
    split = evaluation.split(lm.task.eval_fn, placed, len(lm.eval_data), devices)
    got = split(_replicated(lm.params, devices))
    assert got.keys() == whole.keys()
    # a block's chunks sum in another order: float32 rounding of a 256-window mean
    assert got["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
    assert got == split(_replicated(lm.params, devices))  # deterministic


def test_the_image_tasks_accuracy_and_loss_combine_over_blocks():
    problem = problems.load(tiny(**{"data.corpus": "digits"}), replicas=1)
    whole = {k: float(v) for k, v in problem.task.eval_fn(problem.params,
                                                          problem.eval_data).items()}  # fmt: skip
    devices = jax.devices()[:4]
    placed = evaluation.place(problem.eval_data, devices)
    count = len(problem.eval_data[1])
    got = evaluation.split(problem.task.eval_fn, placed, count, devices)(
        _replicated(problem.params, devices))  # fmt: skip
    assert got["accuracy"] == pytest.approx(whole["accuracy"], rel=1e-6)
    assert got["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)


def test_a_mesh_splits_a_mean_and_keeps_any_other_evaluation_whole():
    """The training loop's Setup: on a 2x2 mesh the built-in LM's evaluation is split, each
    device holding a quarter of the windows (what the memory plan counts); in the simulator it
    is not."""
    mesh = build(tiny(**{"parallel.runtime": "mesh", "parallel.replica_devices": 2,
                         "parallel.data_devices": 2}))  # fmt: skip
    sim = build(tiny(**{"parallel.runtime": "sim"}))
    windows = sim.eval_windows.shape[0]
    assert [s.data.shape[0] for s in mesh.eval_windows.addressable_shards] == [windows // 4] * 4
    assert sim.eval_windows.addressable_shards[0].data.shape[0] == windows
    params = sim.outer_fn(sim.state)
    want = float(sim.evaluate(params)["eval_loss"])
    got = mesh.evaluate(mesh.outer_fn(mesh.state))["eval_loss"]
    assert got == pytest.approx(want, rel=1e-6)
    assert not evaluation.applies(False, sim.eval_windows, jax.devices())  # a user's evaluate
    assert not evaluation.applies(True, np.zeros((3, 2)), jax.devices()[:4])  # fewer than 4


@contextlib.contextmanager
def _lowered():
    """The programs lowered to MLIR or compiled by XLA in the block (their events' names)."""
    events = []

    def listener(event, duration, **kwargs):
        if event in (dispatch.JAXPR_TO_MLIR_MODULE_EVENT, dispatch.BACKEND_COMPILE_EVENT):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("runtime", ["mesh", "sim"])
def test_compiled_ahead_the_first_evaluation_and_check_lower_nothing(runtime):
    """What train() compiles in a thread while the step compiles (issue 28): afterwards the
    loop's first evaluation and replica check lower and compile nothing; without it they do.
    Shapes no other test compiles (a width of 24; 1 or 8 heads), so no earlier test warmed
    them."""
    from diloco_jax.run import distributed
    from diloco_jax.run.loop import _compile_ahead

    mesh = {"parallel.replica_devices": 2} if runtime == "mesh" else {}
    for heads, ahead in ((1, True), (8, False)):
        s = build(tiny(**{"parallel.runtime": runtime, "model.d_model": 24,
                          "model.num_heads": heads, **mesh}))  # fmt: skip
        if ahead:
            _compile_ahead(s, s.state)
        with _lowered() as events:
            loss = s.evaluate(s.outer_fn(s.state))["eval_loss"]
            distributed.check_replicated(s, s.state, s.cfg.outer.sync_every)
        assert np.isfinite(float(loss))
        assert (events == []) == ahead, events
