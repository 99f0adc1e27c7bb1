"""NoLoCo (issue 15): every replica averages with one seeded partner (``lax.ppermute``) and keeps
its own anchor, pulled towards its pair's. Against a hand-computed numpy run; two replicas are
DiLoCo; the chunked simulator and the mesh against the simulator; pairwise bytes and clock;
bad combinations refused with one line."""

import chex
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import diloco, gossip, optim
from diloco_jax.algorithm.gossip import Gossip
from diloco_jax.config import ConfigError, apply_overrides, load_preset, validate
from diloco_jax.runtime import parallel
from tests import helpers
from tests.test_diloco import run_quadratic

CENTERS_4x2 = np.array([[1.0, -2.0], [3.0, 0.5], [-1.0, 1.0], [0.5, 2.5]], np.float32)


def test_pairings_are_seeded_perfect_matchings():
    table = gossip.partners(Gossip(replicas=6, seed=3, pairings=5))
    for partner in table:
        np.testing.assert_array_equal(partner[partner], np.arange(6))  # p's partner is r
        assert (partner != np.arange(6)).all()
    np.testing.assert_array_equal(table, gossip.partners(Gossip(replicas=6, seed=3, pairings=5)))
    assert len({tuple(p) for p in table}) > 1  # the pairs change from sync to sync


def _numpy_noloco(steps, *, g, inner_lr, sync_every, lr, momentum):
    """Inner SGD on 0.5 |x - c_r|^2; at a sync each replica averages its pseudo-gradient with
    its partner's, adds ``pull (phi_r - mean phi)`` and takes a heavy-ball step of its own."""
    table = gossip.partners(g)
    phi = np.zeros((4, 2))
    x, trace = phi.copy(), np.zeros((4, 2))
    for t in range(1, steps + 1):
        x = x - inner_lr * (x - CENTERS_4x2)
        if t % sync_every == 0:
            partner = table[(t // sync_every - 1) % g.pairings]
            delta = phi - x
            applied = (delta + delta[partner]) / 2 + g.pull * (phi - (phi + phi[partner]) / 2)
            trace = applied + momentum * trace
            phi = phi - lr * trace
            x = phi.copy()
    return x, phi


@pytest.mark.parametrize("pull", [1.0, 0.5])
def test_noloco_matches_a_hand_computed_run(pull):
    g = Gossip(replicas=4, seed=1, pull=pull, pairings=2)
    outer = optax.sgd(0.7, momentum=0.5)  # heavy ball, as the authors' code
    tx = diloco(optax.sgd(0.1), outer, sync_every=2, gossip_config=g)
    traj, state = run_quadratic(tx, num_steps=8, centers_RxD=CENTERS_4x2)
    x, phi = _numpy_noloco(8, g=g, inner_lr=0.1, sync_every=2, lr=0.7, momentum=0.5)
    np.testing.assert_allclose(traj[-1], x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.anchor, phi, rtol=1e-5, atol=1e-6)
    assert state.anchor.shape == (4, 2)  # every replica keeps its own anchor
    assert not np.allclose(state.anchor[0], state.anchor[1])
    assert int(state.exchange_state[0][0]) == 4  # syncs counted: pairing n mod 2


def test_two_replicas_are_diloco():
    """With two replicas the partner is the other one: anchors start and stay equal, the pull
    is 0 and the pair's mean is the mean."""
    outer = optim.outer_nesterov()
    noloco, _ = run_quadratic(diloco(optax.sgd(0.1), outer, sync_every=2,
                                     gossip_config=Gossip(replicas=2)), num_steps=6)  # fmt: skip
    plain, _ = run_quadratic(diloco(optax.sgd(0.1), outer, sync_every=2), num_steps=6)
    np.testing.assert_allclose(noloco, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # ~15 s; by default the hand-computed NoLoCo runs and test_chunked's
# test_chunks_train_bitwise_what_all_at_once_trains (the chunks)
def test_noloco_in_chunks_trains_bitwise_what_one_vmap_trains():
    """Under the chunked simulator's stragglers and failures (tests/test_chunked.py): a left-out
    replica's partner averages with itself alone."""
    from tests.test_chunked import R, _run

    def tx(ax):
        return diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4, axis_name=ax,
                      gossip_config=Gossip(replicas=R))  # fmt: skip

    want, _ = _run(tx)
    assert not np.array_equal(want.anchor[0][0], want.anchor[0][1])
    for chunk, offload in ((2, False), (1, True)):
        got, _ = _run(tx, chunk, offload)
        chex.assert_trees_all_equal(got, want, custom_message=f"chunk {chunk}")


def _noloco_tx(axis):
    return diloco(helpers.adamw(), optax.sgd(0.7, momentum=0.5), sync_every=3, axis_name=axis,
                  gossip_config=Gossip(replicas=4))  # fmt: skip


def test_noloco_on_a_mesh_of_one_replica_per_device_equals_the_simulator():
    sim_state, sim_loss = helpers.run(_noloco_tx, helpers.sim(4), 7)
    mesh_state, mesh_loss = helpers.run(_noloco_tx, parallel.Layout("mesh", 4, 4, 2), 7)
    # as tests/test_parallel.py: the same math summed in another order (the data axis)
    chex.assert_trees_all_close(mesh_state, sim_state, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(mesh_loss, sim_loss, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="give each mesh device one replica"):
        helpers.run(_noloco_tx, parallel.Layout("mesh", 4, 2, 1), 4)


def test_pairwise_bytes_and_clock():
    """A 10x10 float32 weight: each replica sends its partner 400 B of pseudo-gradient and
    400 B of anchor at each of 4 syncs; one pairwise exchange takes latency + 800 B / bandwidth,
    less than a ring all-reduce among 4 (6 latencies)."""
    from sim.accounting import account

    done = {"name": "r", "steps": 40, "step_seconds": 0.01, "tokens": 1000,
            "final_eval_loss": 1.0, "evals": [{"eval_loss": 1.0}]}  # fmt: skip
    params = {"w": np.zeros((10, 10), np.float32)}
    rows = {}
    for enabled in ("false", "true"):
        cfg = apply_overrides(load_preset("configs/default.py"), [
            ("outer.sync_every", "10"), ("parallel.replicas", "4"), ("sim.network", "wan_1gbit"),
            ("noloco.enabled", enabled)])  # fmt: skip
        rows[enabled] = account(done, cfg, params)
    assert rows["true"]["bytes_per_replica"] == 4 * 800 and rows["true"]["peak_sync_bytes"] == 800
    assert rows["false"]["bytes_per_replica"] == 4 * 600
    assert rows["true"]["sim_wallclock_s"] < rows["false"]["sim_wallclock_s"]
    assert "noloco" in rows["true"]["codec"]


@pytest.mark.parametrize("overrides,match", [
    ({"parallel.replicas": 3}, r"parallel.replicas = 3 is invalid: must be even"),
    ({"compress.codec": "int8"}, r"noloco.enabled = True is invalid: sends float32"),
    ({"desloc.first_moment_every": 100}, r"noloco.enabled = True .*DES-LOC"),
    ({"algorithm": "ddp"}, r"pairs DiLoCo's replicas"),
])  # fmt: skip
def test_bad_noloco_combinations_are_one_line(overrides, match):
    pairs = [("noloco.enabled", "true"), *((k, str(v)) for k, v in overrides.items())]
    with pytest.raises(ConfigError, match=match):
        validate(apply_overrides(load_preset("configs/default.py"), pairs))


def test_auto_runtime_simulates_noloco_and_a_shared_mesh_device_is_refused():
    from diloco_jax.run import placement

    cfg = apply_overrides(load_preset("configs/default.py"), [("noloco.enabled", "true")])
    assert placement.runtime(cfg) == "sim"
    mesh = apply_overrides(cfg, [("parallel.runtime", "mesh"), ("parallel.replica_devices", "2")])
    with pytest.raises(ConfigError, match="each of the 4 replicas needs its own device"):
        placement.layout(mesh, 4)


def test_noloco_trains_through_the_config_and_resumes_bitwise(tmp_path):

    from diloco_jax.train import train
    from tests.test_checkpoint import assert_bitwise_equal
    from tests.test_train import tiny

    cfg = tiny(**{"noloco.enabled": True, "outer.nesterov": False, "outer.momentum": 0.5})
    full = train(cfg, tmp_path / "full", show_progress=False)
    assert full["final_eval_loss"] < np.log(256)  # it learns, from uniform (5.5 nats)
    assert full["state"].anchor["head"]["kernel"].shape[0] == 4  # an anchor per replica
    helpers.died_after(tmp_path / "full", 10, tmp_path / "cut")
    assert_bitwise_equal(train(cfg, tmp_path / "cut", show_progress=False)["state"],
                         full["state"])  # fmt: skip
