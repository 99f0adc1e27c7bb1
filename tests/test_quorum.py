"""Quorum and grace (issue 15, after Decoupled DiLoCo, arXiv 2604.21428): a sync goes once a
quorum of replicas has finished its round (plus a grace window); a late replica keeps training
and merges at the next sync, measured from the anchor it started from and weighted by its
tokens. The rounds by hand; the algorithm against a hand-computed numpy run; waiting for every
replica is DiLoCo, bitwise; the chunked simulator and a mesh against the simulator; bytes and the
clock by hand; bad combinations refused with one line; through ``train`` with a bitwise resume."""

import chex
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import SyncPlan, diloco, optim
from diloco_jax.config import ConfigError, apply_overrides, load_preset, validate
from diloco_jax.runtime import parallel
from diloco_jax.simulated import schedule
from tests import helpers

CENTERS_3x2 = np.array([[1.0, -2.0], [3.0, 0.5], [-1.0, 1.0]], np.float32)


def test_a_slow_replica_is_late_then_merges_its_two_rounds():
    """H = 10, speeds (1, 1, 1, 0.4), quorum 3, no grace: each sync comes at 10 step times; the
    slow replica takes 4 steps a round, misses one sync and joins the next with 8 steps (0.8 of a
    round's tokens), measured from the anchor two syncs back."""
    r = schedule.quorum_rounds(np.array([1, 1, 1, 0.4]), 10, 3, 0.0, 4)
    np.testing.assert_array_equal(r.steps, np.tile([10, 10, 10, 4], (4, 1)))
    np.testing.assert_array_equal(r.merged[:, 3], [False, True, False, True])
    np.testing.assert_allclose(r.weight[:, 3], [0, 0.8, 0, 0.8])
    assert (r.weight[:, :3] == 1).all() and (r.wall == 10).all()


def test_grace_admits_a_replica_that_arrives_within_the_window():
    """Quorum 2: the second arrival is at 10; replica 2 (speed 0.9) arrives at 11.1, inside a
    grace of 0.15 * 10, so the sync waits until 11.5 and takes it; replica 3 stays late."""
    speeds = np.array([1, 1, 0.9, 0.4])
    r = schedule.quorum_rounds(speeds, 10, 2, 0.15, 2)
    np.testing.assert_allclose(r.wall, [11.5, 11.5])
    np.testing.assert_array_equal(r.merged[0], [True, True, True, False])
    np.testing.assert_array_equal(r.steps[0], [10, 10, 10, 4])  # floor(0.4 * 11.5)
    no_grace = schedule.quorum_rounds(speeds, 10, 2, 0.0, 2)
    np.testing.assert_array_equal(no_grace.merged[0], [True, True, False, False])
    assert no_grace.steps[0][2] == 9 and no_grace.wall[0] == 10
    # the whole quorum: DiLoCo waiting for the slowest (25 step times), everyone weight 1
    everyone = schedule.quorum_rounds(speeds, 10, 4, 0.0, 2)
    assert (everyone.weight == 1).all() and (everyone.steps == 10).all()
    np.testing.assert_allclose(everyone.wall, [25, 25])


def test_masks_are_a_pure_function_of_the_step():
    """A run cut into calls anywhere sees the same masks (a resumed run sees the same rounds)."""
    kw = dict(replicas=4, plan=SyncPlan(10), speeds=np.array([1, 1, 1, 0.4]), dylu=False,
              drops=[], drop_prob=0.0, seed=0, quorum=3)  # fmt: skip
    whole = schedule.control(0, 40, **kw)
    parts = [schedule.control(a, b - a, **kw) for a, b in ((0, 7), (7, 23), (23, 40))]
    for key, value in whole.items():
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), value)
    assert whole["active"][:10, 3].sum() == 4 and whole["active"][:10, :3].all()
    assert not whole["take_anchor"][9, 3] and whole["take_anchor"][19, 3]
    np.testing.assert_allclose(whole["weight"][[9, 19, 29], 3], [0, 0.8, 0])


def _late_control():
    """R = 3, sync_every 2, 6 steps: replica 2 takes one step a round, misses syncs 1 and 3
    and merges at sync 2 with token weight 1.5 (a weight other than 1, to check it is used)."""
    active = np.ones((6, 3), bool)
    active[1::2, 2] = False
    weight = np.ones((6, 3), np.float32)
    weight[[1, 5], 2], weight[3, 2] = 0.0, 1.5
    take = np.ones((6, 3), bool)
    take[[1, 5], 2] = False
    return {"active": active, "weight": weight, "take_anchor": take}


def _numpy_quorum(control, *, inner_lr, lr, momentum):
    """Inner SGD on 0.5 |x - c_r|^2; at a sync the weighted mean of ``base_r - x_r`` feeds a
    heavy-ball step; replicas that take the anchor restart from it and make it their base."""
    anchor, trace = np.zeros(2), np.zeros(2)
    x, base = np.zeros((3, 2)), np.zeros((3, 2))
    for t in range(6):
        step_R = control["active"][t][:, None] * inner_lr * (x - CENTERS_3x2)
        x = x - step_R
        if (t + 1) % 2 == 0:
            w = control["weight"][t]
            mean = (w[:, None] * (base - x)).sum(0) / w.sum()
            trace = mean + momentum * trace
            anchor = anchor - lr * trace
            take = control["take_anchor"][t][:, None]
            x, base = np.where(take, anchor, x), np.where(take, anchor, base)
    return x, anchor


def _tx(late_merge=True, axis="replica", inner=None):
    return diloco(inner or optax.sgd(0.1), optax.sgd(0.7, momentum=0.5), sync_every=2,
                  axis_name=axis, late_merge=late_merge)  # fmt: skip


def test_late_merge_matches_a_hand_computed_run():
    control = _late_control()
    x0 = np.zeros(2, np.float32)
    traj, state, _ = helpers.run_vmapped(_tx(), x0, CENTERS_3x2, 6, control=control)
    x, anchor = _numpy_quorum(control, inner_lr=0.1, lr=0.7, momentum=0.5)
    np.testing.assert_allclose(traj[-1], x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.anchor, anchor, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.base[:2], np.tile(anchor, (2, 1)), rtol=1e-5, atol=1e-6)
    assert not np.allclose(state.base[2], anchor)  # the late replica's base is an older anchor
    # without late_merge the late replica's work since its base is measured from the anchor
    _, plain, _ = helpers.run_vmapped(_tx(False), x0, CENTERS_3x2, 6, control=control)
    assert np.abs(plain.anchor - anchor).max() > 1e-3


def test_waiting_for_every_replica_is_diloco_bitwise():
    x0 = np.zeros(2, np.float32)
    late, late_state, _ = helpers.run_vmapped(_tx(), x0, CENTERS_3x2, 6)
    plain, plain_state, _ = helpers.run_vmapped(_tx(False), x0, CENTERS_3x2, 6)
    chex.assert_trees_all_equal(late, plain)
    chex.assert_trees_all_equal(late_state.anchor, plain_state.anchor)


@pytest.mark.slow  # ~17 s; by default test_late_merge_matches_a_hand_computed_run (the late merge)
# and test_chunked's test_chunks_train_bitwise_what_all_at_once_trains (the chunks)
def test_late_merge_in_chunks_trains_bitwise_what_one_vmap_trains():
    """The chunked simulator's control leaves replica 2 out of its first sync, keeping its own
    parameters: a late replica (tests/test_chunked.py)."""
    from tests.test_chunked import _run

    def tx(ax, late_merge=True):
        return diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4, axis_name=ax,
                      late_merge=late_merge)  # fmt: skip

    want, _ = _run(tx)
    merged_from_anchor, _ = _run(lambda ax: tx(ax, False))
    assert not np.array_equal(want.anchor[0], merged_from_anchor.anchor[0])  # the base counts
    for chunk, offload in ((2, False), (1, True)):
        got, _ = _run(tx, chunk, offload)
        chex.assert_trees_all_equal(got, want, custom_message=f"chunk {chunk}")


def _mesh_control():
    """4 replicas, sync_every 3, 7 steps, from :func:`schedule.control` (replica 3 at 0.5)."""
    return schedule.control(0, 7, replicas=4, plan=SyncPlan(3), speeds=np.array([1, 1, 1, .5]),
                            dylu=False, drops=[], drop_prob=0.0, seed=0, quorum=3)  # fmt: skip


def _mesh_tx(axis):
    return diloco(helpers.adamw(), optim.outer_nesterov(), sync_every=3, axis_name=axis,
                  late_merge=True)  # fmt: skip


def test_late_merge_on_a_mesh_equals_the_simulator():
    control = _mesh_control()
    assert not control["take_anchor"][2, 3] and control["take_anchor"][5, 3]
    sim_state, sim_loss = helpers.run(_mesh_tx, helpers.sim(4), 7, control=control)
    mesh_state, mesh_loss = helpers.run(_mesh_tx, parallel.Layout("mesh", 4, 2, 2), 7,
                                        control=control)  # fmt: skip
    # as tests/test_parallel.py: the same math summed in another order (the data axis)
    chex.assert_trees_all_close(mesh_state, sim_state, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(mesh_loss, sim_loss, atol=1e-5, rtol=1e-5)


def _cfg(*pairs):
    return apply_overrides(load_preset("configs/default.py"), [
        ("outer.sync_every", "10"), ("parallel.replicas", "4"), ("sim.network", "wan_1gbit"),
        ("sim.speeds", "1,1,1,0.5"), *pairs])  # fmt: skip


def test_quorum_bytes_and_clock():
    """A 10x10 float32 weight (400 B), 40 steps, step time 10 ms: waiting for all, 4 rounds of
    20 step times; with quorum 3, rounds of 10 step times and the slow replica in every other
    sync: syncs of 3 and 4 replicas on a ring (2 (n - 1) / n * 400 B each)."""
    from diloco_jax.simulated import comms
    from sim.accounting import account

    done = {"name": "r", "steps": 40, "step_seconds": 0.04, "tokens": 1000,
            "final_eval_loss": 1.0, "evals": [{"eval_loss": 1.0}]}  # fmt: skip
    params = {"w": np.zeros((10, 10), np.float32)}
    wait = account(done, _cfg(), params)
    quorum = account(done, _cfg(("sim.quorum", "3")), params)
    three, four = 2 * 2 / 3 * 400, 2 * 3 / 4 * 400
    assert quorum["bytes_per_replica"] == pytest.approx(2 * (3 * three + 4 * four) / 4)
    assert quorum["peak_sync_bytes"] == pytest.approx(four)
    assert wait["bytes_per_replica"] == pytest.approx(4 * four)
    net = comms.Network(1.0, comms.NETWORKS["wan_1gbit"].latency_ms)
    comm = 2 * (comms.reduce_seconds(400, 3, net) + comms.reduce_seconds(400, 4, net))
    assert quorum["sim_wallclock_s"] == pytest.approx(4 * 10 * 0.01 + comm)
    assert wait["sim_wallclock_s"] == pytest.approx(4 * 20 * 0.01 + 4 * comms.reduce_seconds(
        400, 4, net))  # fmt: skip
    # busy time: per round 3 x 10 steps at 10 ms and the slow replica's 5 at 20 ms (waiting for
    # it: 10 steps at 20 ms); utilization = busy / (4 replicas x wall-clock)
    assert quorum["utilization"] == pytest.approx(4 * 0.4 / (4 * quorum["sim_wallclock_s"]))
    assert wait["utilization"] == pytest.approx(4 * 0.5 / (4 * wait["sim_wallclock_s"]))
    assert quorum["utilization"] > wait["utilization"]
    assert "quorum=3(grace=0)" in quorum["codec"]


@pytest.mark.parametrize("pairs,match", [
    ([("sim.quorum", "5")], r"sim.quorum = 5 is invalid: must be in \[0, parallel.replicas = 4\]"),
    ([("sim.quorum", "3"), ("sim.dylu", "true")], r"sim.quorum = 3 .*sim.dylu"),
    ([("sim.quorum", "3"), ("algorithm", "ddp")], r"sim.quorum = 3 .*algorithm is 'ddp'"),
    ([("sim.quorum", "3"), ("sim.grace", "-1")], r"sim.grace = -1.0 is invalid"),
    ([("sim.quorum", "3"), ("outer.mode", "eager")], r"sim.quorum = 3 .*outer.mode != 'sync'"),
    ([("sim.quorum", "3"), ("noloco.enabled", "true")], r"sim.quorum = 3 is invalid: .*NoLoCo"),
    ([("sim.quorum", "3"), ("desloc.first_moment_every", "20")], r"sim.quorum = 3 .*DES-LOC"),
])  # fmt: skip
def test_bad_quorum_combinations_are_one_line(pairs, match):
    with pytest.raises(ConfigError, match=match):
        validate(_cfg(*pairs))


def test_quorum_trains_through_the_config_and_resumes_bitwise(tmp_path):
    import json

    from diloco_jax.train import train
    from tests.test_checkpoint import assert_bitwise_equal
    from tests.test_train import tiny

    cfg = tiny(**{"sim.speeds": "1,1,1,0.5", "sim.quorum": 3})
    full = train(cfg, tmp_path / "full", show_progress=False)
    assert full["final_eval_loss"] < np.log(256)  # it learns, from uniform (5.5 nats)
    assert full["state"].base["head"]["kernel"].shape[0] == 4  # a base anchor per replica
    # replica 3 (half speed, sync_every 5: 2 steps a round) misses every other sync and merges
    # its 4 steps at the next: weight 0.8
    lines = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    weights = [e["weight"][3] for e in map(json.loads, lines) if e["event"] == "sync"]
    np.testing.assert_allclose(weights, [0, 0.8, 0, 0.8])
    helpers.died_after(tmp_path / "full", 10, tmp_path / "cut")
    assert_bitwise_equal(train(cfg, tmp_path / "cut", show_progress=False)["state"],
                         full["state"])  # fmt: skip
