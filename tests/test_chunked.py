"""The chunked simulator (``sim.chunk``, ``sim.offload``): replicas' inner steps K at a time, the
sync over all of them, the waiting state in host memory; the same training as all at once
(issue 14)."""

import functools

import chex
import jax
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import diloco, init_replicas, optim
from diloco_jax.algorithm.plan import SyncPlan
from diloco_jax.algorithm.variants import Streaming
from diloco_jax.config import ConfigError
from diloco_jax.runtime import chunked, parallel
from diloco_jax.runtime.step import StepControl, make_replica_step
from tests.test_compress import SHAPES, quadratic_task

R, STEPS = 4, 9  # syncs after steps 4 and 8 (sync_every 4), one local step after


def test_segments_cut_a_call_after_each_sync():
    plan = SyncPlan(4)
    assert chunked._segments(3, 10, plan) == [(0, 1, True), (1, 5, True), (5, 9, True),
                                              (9, 10, False)]  # fmt: skip
    assert chunked._segments(0, 3, plan) == [(0, 3, False)]
    assert chunked._segments(0, 4, SyncPlan(4, fragments=2)) == [(0, 2, True), (2, 4, True)]


def _control():
    """Stragglers and failures: replica 1 idles at steps 2-3, replica 2 is left out of the
    first sync and keeps its own parameters; replica 3 weighs double at the second."""
    active = np.ones((STEPS, R), bool)
    active[1:3, 1] = False
    weight = np.ones((STEPS, R), np.float32)
    weight[3, 2], weight[7, 3] = 0.0, 2.0
    take = np.ones((STEPS, R), bool)
    take[3, 2] = False
    return StepControl(active, weight, take, np.ones((STEPS, R), np.float32),
                       np.zeros((STEPS, R), np.int32))  # fmt: skip


def _run(tx, chunk: int = 0, offload: bool = False):
    """``STEPS`` steps of :func:`quadratic_task` (elementwise gradients: every vmap size computes
    them bitwise alike) under the controls above; all at once (``chunk=0``) or chunked."""
    params = [jax.numpy.full(shape, 0.5, jax.numpy.float32) for shape in SHAPES]
    task = quadratic_task(sum(x.size for x in params))
    algorithm = tx("replica")
    make = functools.partial(make_replica_step, task=task, batch_size=2)
    if chunk:
        run = chunked.ChunkedSteps(make(chunked.LocalOnly(algorithm)), algorithm, STEPS,
                                   chunk=chunk, offload=offload)  # fmt: skip
    else:
        run = parallel.simulator_steps(make(algorithm), algorithm.kinds, STEPS)
    state = init_replicas(algorithm, params, R)
    ids = np.arange(R, dtype=np.int32)
    state, metrics = run(state, ids, np.zeros((R, 1)), _control())
    return jax.device_get(state), jax.device_get(metrics)


VARIANTS = {
    "plain": {},
    "int8_ef+fragments": dict(streaming=Streaming(fragments=2),
                              codec=optim.Codec("int8", block=64, min_size=64,
                                                error_feedback=True)),
    "eager": dict(outer_mode="eager"),
}  # fmt: skip


@pytest.mark.parametrize(
    "name", ["plain", *(pytest.param(n, marks=pytest.mark.slow) for n in VARIANTS if n != "plain")]
)  # ~5 s each
def test_chunks_train_bitwise_what_all_at_once_trains(name):
    """Chunks of 2 and of 1 (state in host memory) against one vmap of 4: parameters, anchor,
    outer and exchange state and the sync statistics bitwise equal; the loss (a sum, which XLA
    rounds per vmap size) to float32 rounding."""

    def tx(ax):
        return diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4, axis_name=ax,
                      **VARIANTS[name])  # fmt: skip

    want = _run(tx)
    assert float(np.abs(want[0].anchor[0] - 0.5).max()) > 1e-3  # it trained
    for chunk, offload in ((2, False), (1, True)):
        (state, metrics), message = _run(tx, chunk, offload), f"chunk {chunk}"
        chex.assert_trees_all_equal(state, want[0], custom_message=message)
        loss = metrics.pop("loss")
        chex.assert_trees_all_equal(metrics, {k: v for k, v in want[1].items() if k != "loss"},
                                    custom_message=message)  # fmt: skip
        # a float32 sum of ~1.8k terms in another order per vmap size: a few ulps (2e-7 seen)
        np.testing.assert_allclose(loss, want[1]["loss"], rtol=1e-5, err_msg=message)


@pytest.mark.slow  # ~50 s: three tiny trainings
def test_chunked_train_run_resumes_and_matches_all_at_once(tmp_path):
    """Through ``train``: a tiny model in chunks of 2 with the state in host memory evaluates
    as the all-at-once simulator (float rounding: XLA rounds a model's gradients differently
    per vmap size), and a resumed chunked run continues bitwise."""
    import shutil

    from diloco_jax.train import train
    from tests.test_checkpoint import assert_bitwise_equal, tiny

    cfg = tiny(**{"sim.chunk": 2, "sim.offload": True})
    full = train(cfg, tmp_path / "full", show_progress=False)
    train(cfg, tmp_path / "cut", show_progress=False)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "20")  # as if it died after step 10
    resumed = train(cfg, tmp_path / "cut", show_progress=False)
    assert_bitwise_equal(resumed["state"], full["state"])
    plain = train(tiny(), tmp_path / "plain", show_progress=False)
    # observed: 3.7109758 both (the preset's evals); the model's gradients may round per size
    assert full["final_eval_loss"] == pytest.approx(plain["final_eval_loss"], abs=1e-5)


@pytest.mark.parametrize("overrides,match", [
    ({"sim.chunk": 3}, r"sim.chunk = 3 is invalid: must divide parallel.replicas = 4"),
    ({"sim.chunk": 2, "algorithm": "ddp"}, r"sim.chunk = 2 .*chunks DiLoCo's replicas"),
    ({"sim.chunk": 2, "parallel.runtime": "mesh"}, r"sim.chunk = 2 .*runs in the simulator"),
    ({"sim.chunk": 2, "streaming.fragments": 2, "streaming.overlap": 1, "outer.sync_every": 10},
     r"sim.chunk = 2 .*streaming.overlap > 0"),
    ({"sim.offload": True}, r"sim.offload = True is invalid: needs sim.chunk > 0"),
    ({"sim.chunk": -1}, r"sim.chunk = -1 is invalid: must be >= 0"),
])  # fmt: skip
def test_bad_chunk_settings_are_one_line_errors(overrides, match):
    from diloco_jax.config import validate
    from tests.test_checkpoint import tiny

    with pytest.raises(ConfigError, match=match):
        validate(tiny(**{"model.num_layers": 2, **overrides}))
