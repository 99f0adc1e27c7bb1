"""The simulator (vmap) and the mesh runtime (shard_map on 8 fake CPU devices) agree."""

import chex
import jax
import numpy as np
import pytest

from diloco_jax.algorithm import data_parallel, diloco, optim
from diloco_jax.runtime import parallel
from tests import helpers

STEPS = 8  # two syncs at sync_every=3 plus local steps after the last one


def diloco_tx(axis):
    return diloco(helpers.adamw(), optim.outer_nesterov(), sync_every=3, axis_name=axis)


@pytest.fixture(scope="module")
def simulated():
    return helpers.run(diloco_tx, helpers.sim(4), STEPS)


@pytest.mark.parametrize(
    "replica_devices,data_devices",
    [pytest.param(4, 2, marks=pytest.mark.slow), (2, 1),  # ~10 s each: 2 of 4 by default
     pytest.param(2, 4, marks=pytest.mark.slow), (1, 4)],
    ids=["4x2", "2dev-holding-2-virtual", "2x4", "1dev-holding-4-virtual-x4data"],
)  # fmt: skip
def test_mesh_equals_simulator(simulated, replica_devices, data_devices):
    sim_state, sim_loss = simulated
    layout = parallel.Layout("mesh", 4, replica_devices, data_devices)
    mesh_state, mesh_loss = helpers.run(diloco_tx, layout, STEPS)
    # Same math in another summation order: the data-axis mean averages per-shard gradient
    # means and the replica mean nests two pmeans; float32 reassociation over 8 AdamW steps
    # stays below 1e-5 (observed ~1e-7).
    chex.assert_trees_all_close(mesh_state, sim_state, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(mesh_loss, sim_loss, atol=1e-5, rtol=1e-5)
    assert mesh_state.step.shape == ()


def test_ddp_mesh_equals_simulator():
    tx = lambda ax: data_parallel(helpers.adamw(), axis_name=ax)  # noqa: E731
    sim_state, _ = helpers.run(tx, helpers.sim(2), 4)
    mesh_state, _ = helpers.run(tx, parallel.Layout("mesh", 2, 2, 2), 4)
    chex.assert_trees_all_close(mesh_state, sim_state, atol=1e-5, rtol=1e-5)


def test_same_seed_is_bitwise_identical_and_seed_matters():
    a, _ = helpers.run(diloco_tx, helpers.sim(2), 4)
    b, _ = helpers.run(diloco_tx, helpers.sim(2), 4)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    c, _ = helpers.run(diloco_tx, helpers.sim(2), 4, seed=1)
    assert not np.array_equal(a.anchor["head"]["kernel"], c.anchor["head"]["kernel"])


def test_jitted_step_traces_once():
    from diloco_jax.algorithm import init_replicas, vmap_axes
    from diloco_jax.data import replica_shards
    from diloco_jax.runtime.step import full_control, make_replica_step, scan_steps

    params, task = helpers.bigram_model(), helpers.bigram_task()
    tx = diloco_tx("replica")
    shards_RxS = jax.numpy.asarray(replica_shards(helpers.corpus_train(), 2, helpers.SEQ_LEN))
    step = make_replica_step(tx, task, batch_size=2)
    state = init_replicas(tx, params, 2)
    axes = vmap_axes(tx)
    counted = chex.assert_max_traces(step, n=1)
    fn = jax.jit(scan_steps(jax.vmap(counted, in_axes=(axes, 0, 0, 0), out_axes=(axes, 0),
                                     axis_name="replica"), 2))  # fmt: skip
    ids = jax.numpy.arange(2)
    for _ in range(3):
        state, _ = fn(state, ids, shards_RxS, full_control(2, 2))
    assert int(state.step) == 6


def test_anchor_is_stored_once():
    state, _ = helpers.run(diloco_tx, helpers.sim(4), 1)
    kernel = state.params["head"]["kernel"]
    assert kernel.shape[0] == 4
    assert state.anchor["head"]["kernel"].shape == kernel.shape[1:]
    # the outer (Nesterov) momentum, one state per fragment over its list of leaves: no replica
    # axis either
    momentum = [x for x in jax.tree.leaves(state.outer_state) if x.ndim]
    anchor = jax.tree.leaves(state.anchor)
    assert [x.shape for x in momentum] == [x.shape for x in anchor]


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(replicas=4, batch_size=16, num_devices=1), parallel.Layout("sim", 4, 1, 1)),
        (dict(replicas=4, batch_size=16, num_devices=8), parallel.Layout("mesh", 4, 4, 2)),
        (dict(replicas=3, batch_size=5, num_devices=8), parallel.Layout("mesh", 3, 3, 1)),
        (dict(replicas=8, batch_size=4, num_devices=2), parallel.Layout("mesh", 8, 2, 1)),
        (dict(replicas=4, batch_size=4, runtime="sim", num_devices=8),
         parallel.Layout("sim", 4, 1, 1)),
    ],
)  # fmt: skip
def test_resolve_layout(kwargs, expected):
    assert parallel.resolve_layout(**kwargs) == expected


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(replicas=4, batch_size=8, replica_devices=3, num_devices=8),
         "parallel.replica_devices = 3 .*must divide parallel.replicas = 4"),
        (dict(replicas=4, batch_size=6, replica_devices=2, data_devices=4, num_devices=8),
         "data.batch_size = 6 .*divisible by parallel.data_devices = 4"),
        (dict(replicas=4, batch_size=8, replica_devices=4, data_devices=4, num_devices=8),
         "need 16 devices, but only 8 exist"),
    ],
)  # fmt: skip
def test_resolve_layout_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        parallel.resolve_layout(**kwargs)
