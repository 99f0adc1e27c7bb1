"""Outer optimizers (issue 15): Nesterov SGD, plain SGD, Adam and AdamW on the pseudo-gradient,
with a schedule over outer steps; one replica is SNOO (and Lookahead at momentum 0). Each against
a hand-computed numpy trajectory or optax's own transform; the simulator against the mesh."""

import chex
import jax
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import OptionError, diloco, optim
from diloco_jax.config import ConfigError, apply_overrides, load_preset, validate
from diloco_jax.runtime import parallel
from tests import helpers
from tests.test_diloco import CENTERS_RxD, run_quadratic


def _local_rounds(anchor, inner_lr, sync_every):
    """Every replica's parameters after ``sync_every`` inner SGD steps on 0.5 |x - c_r|^2."""
    local = np.tile(anchor, (len(CENTERS_RxD), 1))
    for _ in range(sync_every):
        local = local - inner_lr * (local - CENTERS_RxD)
    return local


def test_outer_adam_follows_a_hand_computed_adam_on_the_mean_pseudo_gradient():
    lr, b1, b2, eps = 0.3, 0.8, 0.9, 1e-8
    outer = optim.outer_optimizer("adam", learning_rate=lr, b1=b1, b2=b2, eps=eps)
    traj, state = run_quadratic(diloco(optax.sgd(0.1), outer, sync_every=2), num_steps=6)
    anchor, m, v = np.zeros(2), np.zeros(2), np.zeros(2)
    for k in range(1, 4):  # three syncs, Adam with bias correction (Kingma & Ba)
        g = (anchor - _local_rounds(anchor, 0.1, 2)).mean(axis=0)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g**2
        anchor = anchor - lr * (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)
        np.testing.assert_allclose(traj[2 * k - 1], np.tile(anchor, (2, 1)), rtol=2e-6)
    np.testing.assert_allclose(state.anchor, anchor, rtol=2e-6)
    assert int(state.outer_state[0][0].count) == 3  # Adam counted outer steps, not inner ones


def test_outer_adamw_decays_the_anchor_and_plain_sgd_is_momentum_zero():
    outer = optim.outer_optimizer("adamw", learning_rate=0.3, weight_decay=0.5)
    tx = diloco(optax.sgd(0.1), outer, sync_every=2)
    _, decayed = run_quadratic(tx, num_steps=4, x0_D=(1.0, 1.0))
    _, plain = run_quadratic(diloco(optax.sgd(0.1), optim.outer_optimizer(
        "adam", learning_rate=0.3), sync_every=2), num_steps=4, x0_D=(1.0, 1.0))  # fmt: skip
    assert not np.allclose(decayed.anchor, plain.anchor)
    sgd = optim.outer_optimizer("sgd", learning_rate=0.5, momentum=0.0)
    _, got = run_quadratic(diloco(optax.sgd(0.1), sgd, sync_every=2), num_steps=2)
    g = (np.zeros(2) - _local_rounds(np.zeros(2), 0.1, 2)).mean(axis=0)
    np.testing.assert_allclose(got.anchor, -0.5 * g, rtol=1e-6)


def test_the_outer_learning_rate_follows_its_schedule_over_outer_steps():
    lr = optim.outer_schedule(0.8, schedule="cosine", warmup=2, total=6, final_lr_fraction=0.25)
    want = [0.0, 0.4, 0.8] + [0.2 + 0.3 * (1 + np.cos(np.pi * k / 4)) for k in (1, 2, 3, 4)]
    np.testing.assert_allclose([float(lr(k)) for k in range(7)], want, rtol=1e-6)
    linear = optim.outer_schedule(1.0, schedule="linear", total=4, final_lr_fraction=0.0)
    np.testing.assert_allclose([float(linear(k)) for k in range(5)], [1, 0.75, 0.5, 0.25, 0])
    assert optim.outer_schedule(0.7) == 0.7  # constant: a plain float, nothing scheduled
    # in DiLoCo, with plain SGD the k-th outer step moves the anchor by lr(k) * the mean
    outer = optim.outer_optimizer("sgd", learning_rate=1.0, momentum=0.0, schedule="linear",
                                  total=4)  # fmt: skip
    traj, _ = run_quadratic(diloco(optax.sgd(0.1), outer, sync_every=1), num_steps=3)
    anchor = np.zeros(2)
    for k in range(3):
        g = (anchor - _local_rounds(anchor, 0.1, 1)).mean(axis=0)
        anchor = anchor - (1 - k / 4) * g
        np.testing.assert_allclose(traj[k][0], anchor, rtol=1e-6)


def test_one_replica_at_momentum_zero_is_optax_lookahead():
    """SNOO's single-worker case with momentum 0 is Lookahead (Zhang et al., 2019): the slow
    weights move ``alpha`` of the way to the fast ones every ``sync_every`` steps."""
    inner, alpha, k = optax.adam(0.05), 0.5, 3
    outer = optim.outer_optimizer("sgd", learning_rate=alpha, momentum=0.0)
    traj, state = run_quadratic(diloco(inner, outer, sync_every=k), 9, CENTERS_RxD[:1])
    look = optax.lookahead(inner, sync_period=k, slow_step_size=alpha)
    params = optax.LookaheadParams.init_synced(np.zeros(2, np.float32))
    opt_state = look.init(params)
    for t in range(9):
        updates, opt_state = look.update(params.fast - CENTERS_RxD[0], opt_state, params)
        params = optax.apply_updates(params, updates)
        np.testing.assert_allclose(traj[t][0], params.fast, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.anchor, params.slow, rtol=1e-6, atol=1e-7)


def test_snoo_one_replica_with_nesterov_trains_through_the_cli_path(tmp_path):
    from diloco_jax.train import train
    from tests.test_train import tiny

    done = train(tiny(**{"parallel.replicas": 1, "train.checkpoint": False}), tmp_path,
                 show_progress=False)  # fmt: skip
    assert done["final_eval_loss"] < np.log(256)  # it learns, from uniform (5.5 nats)


def _adam_tx(axis):
    outer = optim.outer_optimizer("adam", learning_rate=0.01, schedule="cosine", warmup=1, total=3)
    return diloco(helpers.adamw(), outer, sync_every=3, axis_name=axis)


def test_outer_adam_on_the_mesh_equals_the_simulator():
    sim_state, sim_loss = helpers.run(_adam_tx, helpers.sim(4), 8)
    mesh_state, mesh_loss = helpers.run(_adam_tx, parallel.Layout("mesh", 4, 2, 2), 8)
    chex.assert_trees_all_close(mesh_state, sim_state, atol=1e-5, rtol=1e-5)  # as test_parallel
    chex.assert_trees_all_close(mesh_loss, sim_loss, atol=1e-5, rtol=1e-5)
    assert int(jax.tree.leaves(sim_state.outer_state)[0]) == 2  # two outer steps counted


@pytest.mark.parametrize("optimizer,extra", [
    ("sgd", []), ("sgd", [("outer.nesterov", "false")]), ("adam", []),
    ("adamw", [("outer.weight_decay", "0.1")]),
])  # fmt: skip
def test_the_outer_learning_rate_as_an_input_trains_the_same_bits(optimizer, extra):
    """The training loop's outer optimizer runs at learning rate 1, its update scaled by the
    rate passed in ``StepControl.outer_scale`` (so a sweep of ``outer.learning_rate`` shares
    one compiled step): the same bits as the rate inside the optimizer."""
    from diloco_jax.config import recipe
    from diloco_jax.runtime.step import full_control
    from tests.test_checkpoint import assert_bitwise_equal

    overrides = [("outer.optimizer", optimizer), ("outer.learning_rate", "0.37"), *extra]
    cfg = apply_overrides(load_preset("tiny"), overrides)
    lr = recipe.outer_lr_input(cfg)
    assert lr == 0.37
    steps = 3 * cfg.outer.sync_every  # three syncs: the momentum carries the rate's effect
    params = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
              "b": np.zeros(4, np.float32)}  # fmt: skip
    targets_R = jax.tree.map(lambda x: np.stack([x + r for r in range(4)]), params)
    control = full_control(steps, 4).update_masks()

    def run(as_input, scale):
        algorithm = recipe.algorithm_from_config(cfg, "replica", outer_lr_as_input=as_input)
        ctrl = {**control, "outer_scale": np.full((steps, 4), scale, np.float32)}
        return helpers.run_vmapped(algorithm, params, targets_R, steps, control=ctrl)[0]

    baked = run(False, 1.0)
    assert_bitwise_equal(run(True, lr), baked)
    assert not np.allclose(run(True, 1.0)["w"], baked["w"])  # without the scale, the rate is 1


def test_a_scheduled_outer_learning_rate_stays_in_the_optimizer():
    from diloco_jax.config import recipe

    base = load_preset("tiny")
    assert recipe.outer_lr_input(base) == base.outer.learning_rate
    for overrides in ([("outer.warmup", "2")], [("outer.schedule", "cosine")],
                      [("algorithm", "ddp")]):  # fmt: skip
        assert recipe.outer_lr_input(apply_overrides(base, overrides)) == 1.0


@pytest.mark.parametrize("key,value,match", [
    ("outer.optimizer", "lamb", "outer.optimizer = 'lamb' is invalid: must be one of"),
    ("outer.b2", "1.0", r"outer.b2 = 1.0 is invalid: must be in \[0, 1\)"),
    ("outer.weight_decay", "0.1", "needs outer.optimizer = 'adamw'"),
    ("outer.schedule", "step", "outer.schedule = 'step' is invalid"),
    ("outer.final_lr_fraction", "2", "outer.final_lr_fraction = 2.0 is invalid"),
])  # fmt: skip
def test_bad_outer_options_are_one_line(key, value, match):
    with pytest.raises(ConfigError, match=match):
        validate(apply_overrides(load_preset("configs/tiny.py"), [(key, value)]))
    with pytest.raises(OptionError):
        optim.outer_optimizer(**{"name" if key == "outer.optimizer" else key.split(".")[1]:
                                 float(value) if value[0].isdigit() else value})  # fmt: skip


@pytest.mark.parametrize(("mode", "given", "want"), [
    ("sync", -1.0, 0.9), ("eager", -1.0, 0.5), ("delayed", -1.0, 0.0),
    ("delayed", 0.3, 0.3), ("sync", 0.3, 0.9),
])  # fmt: skip
def test_a_stale_outer_step_takes_the_overlap_momentum(mode, given, want):
    from diloco_jax.config import recipe

    overrides = [("outer.mode", mode), ("outer.overlap_momentum", str(given))]
    cfg = apply_overrides(load_preset("tiny"), overrides)
    assert recipe.outer_momentum(cfg) == want


def test_a_delayed_step_diverges_at_the_papers_momentum_and_converges_at_the_overlap_one():
    """Where the inner steps nearly converge within a round (3 steps of SGD at 0.5 leave 1/8 of
    each replica's distance to its optimum), the stale mean fed to Nesterov momentum 0.9 makes
    the replicas oscillate with a growing amplitude (by about 1.2 a round in a linear model of
    a round: docs/guides/learners.md); at the delayed mode's own momentum (0) they converge."""
    from diloco_jax.config import recipe

    cfg = apply_overrides(load_preset("tiny"), [("outer.mode", "delayed")])
    optimum = CENTERS_RxD.mean(axis=0)
    distances = {}
    for momentum in (0.9, recipe.outer_momentum(cfg)):
        outer = optim.outer_optimizer("sgd", learning_rate=0.7, momentum=momentum, nesterov=True)
        algorithm = diloco(optax.sgd(0.5), outer, sync_every=3, outer_mode="delayed")
        trajectory_TxRxD, _, _ = helpers.run_vmapped(algorithm, np.zeros(2, np.float32),
                                                     CENTERS_RxD, 90)  # fmt: skip
        off_T = np.linalg.norm(trajectory_TxRxD.mean(axis=1) - optimum, axis=-1)
        distances[momentum] = float(off_T[-30:].max())  # the last 10 rounds' farthest
    start = float(np.linalg.norm(optimum))
    assert distances[0.9] > 10 * start  # 30 rounds of growth
    assert distances[0.0] < 1e-2 * start
