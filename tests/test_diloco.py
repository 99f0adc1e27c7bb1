"""The DiLoCo transform: hand-computed trajectories and degenerate equivalences."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import (
    PER_REPLICA,
    SHARED,
    DilocoState,
    OptionError,
    Streaming,
    data_parallel,
    diloco,
    optim,
    single,
)
from diloco_jax.algorithm import state as state_lib
from diloco_jax.algorithm.compress import Codec
from diloco_jax.algorithm.dct import DctConfig
from tests import helpers

CENTERS_RxD = np.array([[1.0, -2.0], [3.0, 0.5]], np.float32)


def run_quadratic(tx, num_steps, centers_RxD=CENTERS_RxD, x0_D=(0.0, 0.0), dtype=np.float32):
    """Replica r minimises 0.5 * |x - c_r|^2 (gradient x - c_r) with ``tx`` under vmap; returns
    the parameters after every step ``[T, R, D]`` and the final state."""
    x_D = jnp.asarray(x0_D, dtype)
    traj, state, _ = helpers.run_vmapped(tx, x_D, jnp.asarray(centers_RxD, dtype), num_steps)
    return traj, state


def reference_quadratic(num_syncs, *, inner_lr, sync_every, outer_lr, momentum):
    """Plain-numpy DiLoCo with inner SGD and outer Nesterov SGD (optax's convention:
    m' = g + mu m; update = -lr (g + mu m'))."""
    anchor = np.zeros(2)
    m = np.zeros(2)
    anchors = []
    for _ in range(num_syncs):
        local = np.tile(anchor, (len(CENTERS_RxD), 1))
        for _ in range(sync_every):
            local = local - inner_lr * (local - CENTERS_RxD)
        g = (anchor - local).mean(axis=0)
        m = g + momentum * m
        anchor = anchor - outer_lr * (g + momentum * m)
        anchors.append(anchor)
    return np.array(anchors)


def test_hand_computed_quadratic_trajectory():
    tx = diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=2)
    traj, state = run_quadratic(tx, num_steps=6)
    # First sync by hand: each replica moves to 0.19 c_r after two steps of x -= 0.1 (x - c);
    # delta = -0.19 mean(c) = -0.19 * [2, -0.75]; Nesterov's first update is -0.7 * 1.9 * delta.
    np.testing.assert_allclose(traj[1], np.tile([[0.5054, -0.189525]], (2, 1)), rtol=1e-5)
    expected = reference_quadratic(3, inner_lr=0.1, sync_every=2, outer_lr=0.7, momentum=0.9)
    np.testing.assert_allclose(traj[1::2], np.repeat(expected[:, None], 2, axis=1), rtol=1e-5)
    np.testing.assert_allclose(state.anchor, expected[-1], rtol=1e-5)
    # between syncs the replicas diverge: each follows its own objective
    assert not np.allclose(traj[2][0], traj[2][1])
    assert int(state.step) == 6 and state.step.shape == ()


def test_pseudo_gradient_sign_mean_over_replicas_only_and_outer_step_not_a_noop():
    # One inner step of sgd(1.0) lands replica r exactly on c_r; outer plain sgd(0.5).
    tx = diloco(optax.sgd(1.0), optax.sgd(0.5), sync_every=1)
    traj, state = run_quadratic(tx, num_steps=1)
    mean_c = CENTERS_RxD.mean(axis=0)  # per coordinate: the mean runs over replicas only
    # delta = anchor - mean(params) = -mean_c; anchor' = 0 - 0.5 * delta = 0.5 mean_c
    np.testing.assert_allclose(state.anchor, 0.5 * mean_c, rtol=1e-6)
    np.testing.assert_allclose(traj[0], np.tile(0.5 * mean_c, (2, 1)), rtol=1e-6)
    # outer Nesterov moves further than plain averaging (sgd(1.0)) would
    tx = diloco(optax.sgd(1.0), optim.outer_nesterov(), sync_every=1)
    _, state = run_quadratic(tx, num_steps=1)
    np.testing.assert_allclose(state.anchor, 1.33 * mean_c, rtol=1e-6)


@pytest.mark.parametrize("sync_every", [1, 3, 7])
def test_one_replica_with_outer_sgd1_is_the_inner_optimizer(sync_every):
    inner = optim.inner_adamw(learning_rate=0.05, total_steps=20, warmup_steps=3)
    centers = CENTERS_RxD[:1]
    traj, _ = run_quadratic(diloco(inner, optax.sgd(1.0), sync_every=sync_every), 20, centers)
    plain, _ = run_quadratic(single(inner), 20, centers)
    # At a sync the replica is set to anchor' = anchor - (anchor - p) = p, up to float rounding.
    np.testing.assert_allclose(traj, plain, rtol=1e-6, atol=1e-6)


def test_syncs_happen_only_every_sync_every_steps():
    tx = diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=3)
    traj, state = run_quadratic(tx, num_steps=5)
    # step 3 is a sync: both replicas equal their average; steps 1, 2, 4, 5 are not
    np.testing.assert_allclose(traj[2][0], traj[2][1])
    np.testing.assert_allclose(traj[2][0], traj[2].mean(0))
    for t in (0, 1, 3, 4):
        assert not np.allclose(traj[t][0], traj[t][1])
    np.testing.assert_allclose(state.anchor, traj[2][0], rtol=1e-6)


def test_reset_inner_state_reinitialises_at_sync():
    inner = optax.adam(0.1)
    tx = diloco(inner, optax.sgd(1.0), sync_every=2, reset_inner_state=True)
    _, state = run_quadratic(tx, num_steps=2)
    fresh = inner.init(jnp.zeros(2))
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], state.inner_state), fresh)
    _, kept = run_quadratic(diloco(inner, optax.sgd(1.0), sync_every=2), num_steps=2)
    assert int(kept.inner_state[0].count[0]) == 2


def test_step_counter_is_shared_and_the_sync_stays_a_branch():
    tx = diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=4)
    axes = state_lib.vmap_axes(tx.kinds)
    stacked = state_lib.stack(tx.init(jnp.zeros(2)), tx.kinds, 1)
    assert stacked.step.shape == ()

    def one(state, c):
        return tx.update(state, state.params - c)

    jaxpr = jax.make_jaxpr(
        jax.vmap(one, in_axes=(axes, 0), out_axes=(axes, 0), axis_name="replica")
    )(stacked, jnp.zeros((1, 2)))
    primitives = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert "cond" in primitives  # a select_n would run the outer step on every inner step


def test_inner_sgd_sync1_outer_sgd1_is_synchronous_data_parallel_sgd():
    """DiLoCo(sgd, sgd(1.0), sync_every=1) with R replicas of batch B == SGD at batch R*B ==
    the ddp baseline."""
    replicas, steps, lr = 4, 3, 0.5
    dil, _ = helpers.run(
        lambda ax: diloco(optax.sgd(lr), optax.sgd(1.0), sync_every=1, axis_name=ax),
        helpers.sim(replicas), steps,
    )  # fmt: skip
    ddp, _ = helpers.run(
        lambda ax: data_parallel(optax.sgd(lr), axis_name=ax), helpers.sim(replicas), steps
    )
    reference = big_batch_sgd(replicas, steps, lr)
    anchor = dil.anchor
    chex.assert_trees_all_close(anchor, reference, atol=2e-6)
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], ddp.params), reference, atol=2e-6)
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[3], dil.params), reference, atol=2e-6)


def big_batch_sgd(replicas, steps, lr):
    """One model, plain SGD on the concatenation of every replica's batch."""
    from diloco_jax.data import replica_shards, sample_batch

    params, loss = helpers.bigram_model(), jax.jit(jax.grad(helpers.bigram_loss))  # helpers.run's
    shards_RxS = jnp.asarray(replica_shards(helpers.corpus_train(), replicas, helpers.SEQ_LEN))

    for step in range(steps):
        tokens = jnp.concatenate([
            sample_batch(shards_RxS[r], seed=0, replica=jnp.int32(r), step=jnp.int32(step),
                         batch_size=helpers.BATCH, seq_len=helpers.SEQ_LEN)
            for r in range(replicas)
        ])  # fmt: skip
        grads = loss(params, tokens)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return params


def test_every_replica_fed_the_same_data_equals_one_replica():
    tx = lambda ax: diloco(helpers.adamw(), optim.outer_nesterov(), sync_every=3, axis_name=ax)  # noqa: E731
    four, _ = helpers.run(tx, helpers.sim(4), 7, replica_ids=[0, 0, 0, 0])
    one, _ = helpers.run(tx, helpers.sim(1), 7, shards=4)
    # vmaps of 4 and 1 round the model's gradients differently (2.4e-7 seen after 7 AdamW
    # steps on an AMD EPYC; another CPU's kernels may do more): atol 2e-6
    chex.assert_trees_all_close(four.anchor, one.anchor, atol=2e-6)
    for r in range(4):
        chex.assert_trees_all_close(
            jax.tree.map(lambda x, r=r: x[r], four.params),
            jax.tree.map(lambda x: x[0], one.params), atol=2e-6,
        )  # fmt: skip


def test_kinds_declare_each_field_once_and_every_layout_follows():
    tx = diloco(optax.adam(0.1), optax.sgd(1.0), sync_every=2)
    assert tx.kinds == DilocoState(
        step=SHARED, params=PER_REPLICA, inner_state=PER_REPLICA, anchor=SHARED,
        outer_state=SHARED, exchange_state=PER_REPLICA, timing_state=(), healthy=PER_REPLICA,
        base=PER_REPLICA,
    )  # fmt: skip
    stacked = state_lib.stack(tx.init({"w": jnp.zeros(3)}), tx.kinds, 4)
    assert stacked.params["w"].shape == (4, 3) and stacked.anchor["w"].shape == (3,)
    assert all(x.shape[0] == 4 for x in jax.tree.leaves(stacked.inner_state))
    assert stacked.step.shape == () and stacked.healthy.shape == (4,)
    axes = state_lib.vmap_axes(tx.kinds)
    assert (axes.step, axes.params, axes.anchor, axes.outer_state) == (None, 0, None, None)
    specs = state_lib.specs(tx.kinds)
    assert (
        specs.anchor == jax.sharding.PartitionSpec()
        and specs.params == jax.sharding.PartitionSpec("replica")
    )
    assert state_lib.replica_count(stacked, tx.kinds) == 4
    shared = state_lib.shared_part(stacked, tx.kinds)
    assert shared.params == () and shared.anchor is stacked.anchor
    # eager updates make the anchor and outer state per replica, and nothing else
    eager = diloco(optax.adam(0.1), optax.sgd(1.0), sync_every=2, outer_mode="eager").kinds
    assert (eager.anchor, eager.outer_state, eager.step) == (PER_REPLICA, PER_REPLICA, SHARED)
    assert eager.timing_state.pending == SHARED and eager.timing_state.last_share == PER_REPLICA
    # a field whose kind is not declared cannot be built
    with pytest.raises(TypeError):
        DilocoState(*tx.kinds[:-1])


def test_sync_every_below_one_is_rejected():
    with pytest.raises(ValueError, match="sync_every = 0 is invalid: must be an integer >= 1"):
        diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=0)


@pytest.mark.parametrize(
    "kwargs,option,allowed",
    [
        (dict(streaming=Streaming(fragments=2), outer_mode="eager"), "outer_mode",
         "must be 'sync' with streaming (streaming.fragments > 1 or streaming.overlap > 0)"),
        (dict(streaming=Streaming(overlap=1), dct_config=DctConfig()), "dct_config",
         "DCT momentum does not combine with streaming"),
        (dict(codec=Codec("int8"), dct_config=DctConfig()), "dct_config", "not both"),
        (dict(codec=Codec("int8", block=3)), "codec.block", "must be an even integer >= 2"),
        (dict(dct_config=DctConfig(chunk=8, topk=9)), "dct.topk", "must be in [1, dct.chunk = 8]"),
        (dict(outer_mode="lazy"), "outer_mode", "must be one of"),
    ],
)  # fmt: skip
def test_option_errors_name_the_argument_and_map_to_other_names(kwargs, option, allowed):
    """Every refused argument raises OptionError naming it; an edge renders the rule with its
    own names (the config layer's keys)."""
    with pytest.raises(OptionError) as info:
        diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=4, **kwargs)
    assert info.value.option == option and allowed in str(info.value)
    renamed = info.value.render({"dct.chunk": "compress.dct_chunk"})
    assert "dct.chunk" not in renamed.replace("compress.dct_chunk", "")


def _poison(replicas_to_poison):
    """Sets the parameters of some replicas to NaN (as if their training blew up)."""

    def prepare(state):
        def poison(x):
            mask = jnp.zeros(x.shape[0], bool).at[jnp.asarray(replicas_to_poison)].set(True)
            return jnp.where(mask.reshape(-1, *[1] * (x.ndim - 1)), jnp.nan, x)

        return state._replace(params=jax.tree.map(poison, state.params))

    return prepare


def _nan_tx(ax):
    return diloco(helpers.adamw(), optim.outer_nesterov(), sync_every=3, axis_name=ax)


def test_nan_replica_is_left_out_and_restarts_from_the_anchor():
    state, metrics = helpers.run(_nan_tx, helpers.sim(4), 6, prepare=_poison([1]))
    first_sync = 2  # metrics index of step 3
    np.testing.assert_array_equal(metrics["finite"][first_sync], [True, False, True, True])
    np.testing.assert_array_equal(metrics["weight"][first_sync], [1, 0, 1, 1])
    assert metrics["contributors"][first_sync][0] == 3
    assert np.isnan(metrics["loss"][:first_sync, 1]).all()  # it was broken before the sync
    assert np.isfinite(metrics["loss"][first_sync + 1 :]).all()  # and trains again after it
    assert metrics["finite"][5].all() and metrics["contributors"][5][0] == 4
    o = state
    for leaf in jax.tree.leaves((state.params, o.inner_state, o.anchor, o.outer_state)):
        assert np.isfinite(np.asarray(leaf, np.float32)).all()
    # the anchor of the first sync is the 3 healthy replicas' outer step: same as running
    # without replica 1's contribution (weight 0 via the control)
    masks = schedule_without(replica=1, steps=3, replicas=4)
    clean, _ = helpers.run(_nan_tx, helpers.sim(4), 3, control=masks)
    poisoned, _ = helpers.run(_nan_tx, helpers.sim(4), 3, prepare=_poison([1]))
    chex.assert_trees_all_close(poisoned.anchor, clean.anchor, atol=1e-6)


def schedule_without(*, replica, steps, replicas):
    weight = np.ones((steps, replicas), np.float32)
    weight[:, replica] = 0
    return {"active": np.ones((steps, replicas), bool), "weight": weight,
            "take_anchor": np.ones((steps, replicas), bool)}  # fmt: skip


def test_all_replicas_nan_discards_the_outer_step():
    state, metrics = helpers.run(_nan_tx, helpers.sim(2), 3, prepare=_poison([0, 1]))
    params = helpers.bigram_model()  # helpers.run's
    chex.assert_trees_all_close(state.anchor, params)  # anchor unchanged
    for leaf in jax.tree.leaves(state.outer_state):
        np.testing.assert_array_equal(leaf, 0)  # no momentum from a discarded step
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[0], state.params), params, atol=1e-7)
    assert metrics["contributors"][2][0] == 0 and not metrics["finite"][2].any()
