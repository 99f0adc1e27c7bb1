"""Streaming DiLoCo, delayed and eager outer steps, DCT momentum: hand-computed trajectories on
tiny quadratics, degenerate equivalences, simulator == mesh, and what travels."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import Streaming, SyncPlan, dct, diloco, exchange, fragments, optim
from diloco_jax.runtime import parallel
from tests import helpers

NESTEROV = dict(outer_lr=0.7, mu=0.9)
TARGETS_RxFxD = np.array([[[1.0, -2.0], [0.5, 3.0]], [[3.0, 0.5], [-1.0, 2.0]]], np.float32)


def as_params(x_FxD):
    """Two "layers" of one vector each: layer f is fragment f under strided assignment."""
    return {"blocks": {f: {"w": x_FxD[..., f, :]} for f in range(x_FxD.shape[-2])}}


def run_tree(tx, num_steps, targets_RxFxD=TARGETS_RxFxD):
    """Replica r minimises 0.5 |x - target_r|^2 with ``tx`` under vmap (parameters in the
    targets' dtype); returns the stacked parameters after every step (``[T, R, F, D]``) and the
    final state."""
    x = as_params(jnp.zeros(targets_RxFxD.shape[1:], targets_RxFxD.dtype))
    traj, state, _ = helpers.run_vmapped(tx, x, as_params(jnp.asarray(targets_RxFxD)), num_steps)
    return np.stack([traj["blocks"][f]["w"] for f in sorted(traj["blocks"])], axis=2), state


def nesterov(g, m, outer_lr, mu):
    """optax's Nesterov: m' = g + mu m; update = -lr (g + mu m')."""
    m = g + mu * m
    return -outer_lr * (g + mu * m), m


def reference_streaming(steps, *, sync_every, num_fragments, overlap, mix, lr=0.1,
                        targets=TARGETS_RxFxD):  # fmt: skip
    """Plain numpy Streaming DiLoCo, inner SGD, written from the paper's description."""
    x = np.zeros_like(targets)
    anchor, m = np.zeros(x.shape[1:]), np.zeros(x.shape[1:])
    period, out = sync_every // num_fragments, []
    for step in range(1, steps + 1):
        x = x - lr * (x - targets)
        if step % period == 0:  # fragment f's sync starts
            f = (step // period) % num_fragments
            update, m[f] = nesterov((anchor[f] - x[:, f]).mean(0), m[f], **NESTEROV)
            anchor[f] += update
        if step > overlap and (step - overlap) % period == 0:  # and lands tau steps later
            f = ((step - overlap) // period) % num_fragments
            x[:, f] = mix * x[:, f] + (1 - mix) * anchor[f]
        out.append(x.copy())
    return np.stack(out)


@pytest.mark.parametrize("overlap,mix", [(0, 0.0), (1, 0.3), (1, 0.0)])
def test_streaming_hand_computed(overlap, mix):
    streaming = Streaming(fragments=2, overlap=overlap, mix=mix)
    tx = diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4, streaming=streaming)
    traj, state = run_tree(tx, 12)
    expected = reference_streaming(12, sync_every=4, num_fragments=2, overlap=overlap, mix=mix)
    np.testing.assert_allclose(traj, expected, rtol=1e-5, atol=1e-6)
    # one outer state per fragment, each moved only by its own syncs
    assert len(state.outer_state) == 2
    # at step 2 fragment 1 synced, fragment 0 did not: replicas agree on layer 1 only (tau=0)
    if overlap == 0 and mix == 0:
        np.testing.assert_array_equal(traj[1][0, 1], traj[1][1, 1])
        assert not np.allclose(traj[1][0, 0], traj[1][1, 0])


def test_streaming_schedule_by_hand_on_device_and_host():
    plan = SyncPlan(sync_every=6, fragments=3, overlap=1)
    steps = jnp.arange(1, 13)
    on, which = plan.starting(steps)  # a sync every 2 steps, fragments 1, 2, 0, ...
    assert list(np.flatnonzero(on) + 1) == [2, 4, 6, 8, 10, 12]
    assert list(np.asarray(which)[np.asarray(on)]) == [1, 2, 0, 1, 2, 0]
    on, which = plan.landing(steps)
    assert list(np.flatnonzero(on) + 1) == [3, 5, 7, 9, 11]
    assert list(np.asarray(which)[np.asarray(on)]) == [1, 2, 0, 1, 2]
    # the host asks the same plan with Python ints
    assert plan.sync_steps(1, 12)[:3] == [(2, 1), (4, 2), (6, 0)]
    assert plan.sync_steps(5, 9) == [(6, 0), (8, 1)]
    assert [plan.starting(t) for t in (5, 6)] == [(False, 2), (True, 0)]
    assert plan.rounds(12) == 2 and plan.boundary(12) and not plan.boundary(8)
    errors = [
        (SyncPlan(0), "sync_every = 0 is invalid: must be an integer >= 1"),
        (SyncPlan(6, 4), "streaming.fragments = 4 is invalid: must divide sync_every = 6"),
        (SyncPlan(6, 3, 2), "overlap = 2 .*must be < sync_every / streaming.fragments = 2"),
    ]
    for bad, match in errors:
        with pytest.raises(ValueError, match=match):
            bad.validate()


def test_strided_assignment_balances_the_rest():
    _, params = helpers.tiny_model()  # one layer: fragment 1 takes the embeddings and the head
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    assignment = fragments.strided(params, 2)
    for (path, _), f in zip(leaves, assignment, strict=True):
        if "blocks" in jax.tree_util.keystr(path):
            assert f == 0
    sizes = [sum(leaf.size for (_, leaf), g in zip(leaves, assignment, strict=True) if g == f)
             for f in range(2)]  # fmt: skip
    assert min(sizes) > 0
    with pytest.raises(ValueError, match="hold no parameters"):
        fragments.groups([0, 0, 2], 3)


def reference_delayed(rounds, *, eager, sync_every=3, lr=0.1, targets=TARGETS_RxFxD):
    """Plain numpy delayed (or eager) outer steps; inner SGD; returns each round's anchors
    ``[rounds, R, F, D]`` (the same for every replica when delayed)."""
    replicas = targets.shape[0]
    anchor = np.zeros_like(targets)
    m, pending, last_share, out = np.zeros_like(anchor), 0.0, np.zeros_like(anchor), []
    for _ in range(rounds):
        x = anchor.copy()
        for _ in range(sync_every):
            x = x - lr * (x - targets)
        delta = anchor - x
        if eager:  # my fresh share replaces my stale one in the last mean
            share = delta / replicas
            applied, pending, last_share = pending + share - last_share, delta.mean(0), share
        else:
            applied, pending = np.broadcast_to(pending, delta.shape), delta.mean(0)
        update, m = nesterov(applied, m, **NESTEROV)
        anchor = anchor + update
        out.append(anchor.copy())
    return np.stack(out)


@pytest.mark.parametrize("mode", ["delayed", "eager"])
def test_delayed_and_eager_hand_computed(mode):
    tx = diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=3, outer_mode=mode)
    traj, state = run_tree(tx, 12)
    expected = reference_delayed(4, eager=mode == "eager")
    # every replica restarts from its anchor after each sync
    np.testing.assert_allclose(traj[2::3], expected, rtol=1e-5, atol=1e-6)
    if mode == "delayed":  # the first outer step applies nothing: still at the start
        np.testing.assert_array_equal(traj[2], 0.0)
    else:  # eager anchors differ between replicas (their own fresh shares)
        assert not np.allclose(traj[5][0], traj[5][1])
        assert state.anchor["blocks"][0]["w"].shape == (2, 2)  # per replica


@pytest.mark.slow  # ~20 s; eager is checked by hand and on every layout in the default suite
def test_eager_with_one_replica_is_plain_diloco():
    """With R=1 the eager proxy is mean^(t-1) + delta^(t) - delta^(t-1) = delta^(t)."""
    tx = lambda mode: lambda ax: diloco(helpers.adamw(), optim.outer_nesterov(), sync_every=3,
                                        axis_name=ax, outer_mode=mode)  # fmt: skip  # noqa: E731
    eager, _ = helpers.run(tx("eager"), helpers.sim(1), 6)
    plain, _ = helpers.run(tx("sync"), helpers.sim(1), 6)
    anchor = jax.tree.map(lambda x: x[0], eager.anchor)  # per replica
    chex.assert_trees_all_close(anchor, plain.anchor, atol=1e-6)
    # and the delayed mode is not: it applies each round's mean one round late
    delayed, _ = helpers.run(tx("delayed"), helpers.sim(1), 6)
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), delayed.anchor,
                        plain.anchor)  # fmt: skip
    assert max(jax.tree.leaves(diff)) > 1e-4


def test_dct_matrix_is_orthonormal_and_extract_splits_exactly():
    d = dct.matrix(16)
    np.testing.assert_allclose(d @ d.T, np.eye(16), atol=1e-6)
    flat = jax.random.normal(jax.random.key(0), (8 * 16,))
    config = dct.DctConfig(chunk=16, topk=3)
    message, kept = dct.extract(flat, config)
    vals, idx, _ = message
    assert vals.shape == (8, 3) and idx.dtype == jnp.uint8
    sent = dct.decode(message, config)
    np.testing.assert_allclose(sent + kept, flat, atol=1e-5)  # nothing is lost: sent + kept
    coefficients = np.asarray(flat).reshape(8, 16) @ d.T
    for row in range(8):  # the 3 largest coefficients of each chunk, by magnitude
        top = set(np.argsort(-np.abs(coefficients[row]))[:3])
        assert set(np.asarray(idx[row]).tolist()) == top
    _, nothing_left = dct.extract(flat, dct.DctConfig(chunk=16, topk=16))
    np.testing.assert_allclose(nothing_left, 0.0, atol=1e-5)
    assert dct.message_bytes(1000, dct.DctConfig(chunk=64, topk=4)) == 16 * 4 * (4 + 1)


def test_dct_momentum_keeps_the_rest_and_averages_what_was_sent():
    config = dct.DctConfig(chunk=8, topk=2, beta=0.5, min_size=0)
    ex = exchange.dct_momentum("r", config)
    delta_Rx40 = jax.random.normal(jax.random.key(1), (3, 40))
    m_Rx40 = jax.random.normal(jax.random.key(2), (3, 40))

    def one(delta, m):
        mean, m_new, total_w = ex.mean([delta], jnp.float32(1.0), jnp.bool_(True), m)
        return mean[0], m_new, total_w

    mean, m_new, total_w = jax.vmap(one, axis_name="r")(delta_Rx40, m_Rx40)
    sent = [np.asarray(dct.decode(dct.extract(0.5 * m_Rx40[r] + delta_Rx40[r], config)[0],
                                  config)) for r in range(3)]  # fmt: skip
    for r in range(3):
        np.testing.assert_allclose(m_new[r], 0.5 * m_Rx40[r] + delta_Rx40[r] - sent[r],
                                   atol=1e-5)  # fmt: skip
        np.testing.assert_allclose(mean[r], np.mean(sent, axis=0), atol=1e-5)
    assert float(total_w[0]) == 3.0


@pytest.mark.slow  # ~20 s; DCT's exchange is checked by hand in the default suite
def test_dct_sending_everything_without_momentum_is_plain_diloco():
    def tx(config):
        return lambda ax: diloco(helpers.adamw(), optim.outer_nesterov(), sync_every=3,
                                 axis_name=ax, dct_config=config)  # fmt: skip

    full = dct.DctConfig(chunk=16, topk=16, beta=0.0, min_size=64)
    everything, _ = helpers.run(tx(full), helpers.sim(4), 6)
    plain, _ = helpers.run(tx(None), helpers.sim(4), 6)
    chex.assert_trees_all_close(everything.anchor, plain.anchor, atol=1e-5)
    partial, _ = helpers.run(tx(full._replace(topk=2)), helpers.sim(4), 6)
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), partial.anchor,
                        plain.anchor)  # fmt: skip
    assert max(jax.tree.leaves(diff)) > 1e-4  # sending 2 of 16 components is not lossless


VARIANTS = {
    "streaming": dict(streaming=Streaming(fragments=2, overlap=1, mix=0.5)),
    "streaming_int8": dict(streaming=Streaming(fragments=2),
                           codec=optim.Codec("int8", block=64, min_size=64)),
    "delayed": dict(outer_mode="delayed"),
    "eager": dict(outer_mode="eager"),
    "dct": dict(dct_config=dct.DctConfig(chunk=16, topk=4, min_size=64)),
}  # fmt: skip


# eager and streaming_int8 exercise the same code paths; DCT momentum is compared on every
# layout at the exchange level by default (tests/test_compress.py)
SLOW = ("delayed", "streaming", "dct")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(VARIANTS)]
)
def test_simulator_equals_every_mesh_layout(name):
    """Each variant computes the same params, anchor and exchange state in the simulator and on
    the layouts that differ in mechanism (tests/test_compress.DISTINCT; all three in the slow
    variants)."""
    from tests.test_compress import DISTINCT, LAYOUTS, assert_close_but_for_dct_ties, run_quadratic

    def tx(ax, inner=None):
        return diloco(inner or helpers.adamw(), optim.outer_nesterov(), sync_every=4,
                      axis_name=ax, **VARIANTS[name])  # fmt: skip

    def run(layout):
        # four leaves (two of them encoded, two float32; balanced into the streaming fragments)
        # trained on a quadratic, whose gradients every layout computes bitwise alike (a
        # model's are rounded differently per vmap batch size, ~1e-7) and which compiles in a
        # fraction of the time. With a codec or DCT momentum the inner optimizer is SGD: AdamW's
        # clipping norm is a reduction, rounded per batch size, which int8 may turn into a code
        # step and the DCT's top-k into another coefficient sent.
        lossy = "codec" in VARIANTS[name] or "dct_config" in VARIANTS[name]
        inner = optax.sgd(0.1) if lossy else None
        return run_quadratic(functools.partial(tx, inner=inner), layout, 9, np.ones((9, 4)))

    sim_state = run(helpers.sim(4))
    for layout_name in DISTINCT if name not in SLOW else LAYOUTS:
        mesh_state = run(LAYOUTS[layout_name])
        compared = [(mesh_state.params, sim_state.params), (mesh_state.anchor, sim_state.anchor),
                    (mesh_state.outer_state, sim_state.outer_state),
                    (mesh_state.timing_state, sim_state.timing_state),
                    (mesh_state.exchange_state, sim_state.exchange_state)]  # fmt: skip
        if name == "dct":  # the DCT's matmuls round per layout: a top-k near tie may move a chunk
            assert_close_but_for_dct_ties(*zip(*compared, strict=True))
            continue
        # float32 rounding: AdamW's clipping norm (see above) and the float32 mean, which nests
        # two pmeans; atol 1e-6 for values near 0 (observed <= 2e-7). int8 is no looser: with
        # inner SGD its inputs are bitwise equal on every layout by construction (each virtual
        # replica encodes its own pseudo-gradient and every sum over replicas runs in replica
        # order, tests/test_compress.py). Eager's per-replica anchor and outer state are
        # compared whole.
        for got, want in compared:
            chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6,
                                        custom_message=f"{name} on {layout_name}")  # fmt: skip


def _compiled_mesh_hlo(**variant) -> tuple[str, dict]:
    def tx(ax):
        return diloco(helpers.adamw(), optim.outer_nesterov(), sync_every=4, axis_name=ax,
                      **variant)  # fmt: skip

    return helpers.compiled_hlo(tx, parallel.Layout("mesh", 4, 4, 1), 4)


@pytest.mark.slow  # ~14 s; the int8 wire format is checked by default
def test_streaming_reduces_one_fragment_at_a_time_on_the_mesh():
    """Each all-reduce of the compiled mesh step carries at most one fragment's values: the
    peak bytes of a sync fall with F."""
    from tests.test_compress import _collectives

    def peak(hlo):
        per_instruction = []
        for line in hlo.splitlines():
            found = _collectives(line, "all-reduce")
            per_instruction.append(sum(n for t, n in found if t == "f32"))
        return max(per_instruction)

    hlo_1, params = _compiled_mesh_hlo()
    hlo_2, _ = _compiled_mesh_hlo(streaming=Streaming(fragments=2))
    total = sum(x.size for x in jax.tree.leaves(params))
    groups = fragments.groups(fragments.strided(params, 2), 2)
    leaves = jax.tree.leaves(params)
    largest = max(sum(leaves[i].size for i in idx) for idx in groups)
    scalars = 16  # XLA may fuse the weight and count scalars into the same all-reduce
    assert total <= peak(hlo_1) <= total + scalars
    assert peak(hlo_2) <= largest + scalars and largest < total
    assert peak(hlo_2) < 0.75 * peak(hlo_1), (peak(hlo_1), peak(hlo_2))


def test_dct_momentum_sends_values_and_uint8_positions_on_the_mesh():
    from tests.test_compress import _collectives

    config = dct.DctConfig(chunk=16, topk=4, min_size=64)
    hlo, params = _compiled_mesh_hlo(dct_config=config)
    big = sum(x.size for x in jax.tree.leaves(params) if x.size >= 64)
    chunks = dct.padded(big, 16) // 16
    gathered = _collectives(hlo, "all-gather")
    # everybody's K positions (uint8) and K values per chunk, 4 replicas
    assert sum(n for t, n in gathered if t == "u8") == chunks * 4 * 4
    assert sum(n for t, n in gathered if t == "f32") >= chunks * 4 * 4
    reduced = _collectives(hlo, "all-reduce")
    assert max(n for t, n in reduced if t == "f32") < 64  # the small leaves only


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"streaming.fragments": "3"}, "streaming.fragments = 3 .*must divide outer.sync_every"),
        ({"streaming.fragments": "2", "model.num_layers": "1", "outer.sync_every": "10"},
         "must be <= model.num_layers = 1"),
        ({"streaming.fragments": "2", "streaming.overlap": "25"},
         r"streaming.overlap = 25 .*< outer.sync_every / streaming.fragments = 25"),
        ({"streaming.mix": "1.0"}, r"streaming.mix = 1.0 .*\[0, 1\)"),
        ({"outer.mode": "lazy"}, "outer.mode = 'lazy' .*one of"),
        ({"outer.mode": "eager", "streaming.fragments": "2"}, "must be 'sync' with streaming"),
        ({"outer.mode": "eager", "algorithm": "ddp"}, "overlaps DiLoCo's outer step"),
        ({"compress.codec": "dct", "compress.dct_topk": "65"},
         r"compress.dct_topk = 65 .*must be in \[1, compress.dct_chunk = 64\]"),
        ({"compress.codec": "dct", "streaming.overlap": "1"},
         r"compress.codec = 'dct' .*DCT momentum does not combine with streaming \(streaming"),
        ({"outer.reset_inner_state": "true", "streaming.fragments": "2"},
         "outer.reset_inner_state = True .*does not combine with streaming.fragments > 1"),
        ({"compress.codec": "dct", "compress.error_feedback": "true"}, "accumulator already"),
        ({"streaming.fragments": "2", "sim.dylu": "true"}, "stragglers or failures"),
    ],
)  # fmt: skip
def test_variant_config_errors_name_key_value_and_rule(overrides, match):
    from diloco_jax.config import Config, ConfigError, apply_overrides, validate

    with pytest.raises(ConfigError, match=match):
        validate(apply_overrides(Config(), list(overrides.items())))


def test_fragment_and_dct_payloads_hand_computed():
    from diloco_jax.simulated import comms

    params = {"blocks": {0: {"w": jnp.zeros(5000)}, 1: {"w": jnp.zeros(3000)}},
              "head": jnp.zeros(1000)}  # fmt: skip
    # strided: layer 0 -> 0, layer 1 -> 1; the head joins the smaller fragment (1)
    assert comms.sync_payloads(params, None, 4, num_fragments=2) == [5000 * 4, 4000 * 4]
    assert comms.sync_payloads(params, None, 4) == [9000 * 4]
    config = dct.DctConfig(chunk=64, topk=4, min_size=2000)
    # 8000 big values: 125 chunks x 4 x (4 + 1) bytes per message; the head in float32; the
    # all-gather is written as P = R * message / 2 (as topk: see comms.sync_payload)
    assert comms.sync_payload(params, None, 4, config) == 4 * 125 * 4 * 5 // 2 + 1000 * 4
    assert comms.diloco_sync_events(100, 50, 2) == [1, 0, 1, 0]


def test_overlapped_reduce_stalls_only_past_the_hidden_compute():
    from diloco_jax.simulated import comms
    from sim import clock

    net = comms.Network(bandwidth_gbps=8.0, latency_ms=1.0)  # reduce of 1e6 B, R=2: 3 ms
    kw = dict(algorithm="diloco", steps=20, sync_every=10, replicas=2, speeds=np.ones(2),
              dylu=False, network=net)  # fmt: skip
    blocking = clock.simulate(step_time_s=0.1, payload_bytes=10**6, **kw)
    assert blocking.comm_s == pytest.approx(2 * 3e-3)
    # delayed/eager: the reduce hides behind a 10-step round: no stall
    hidden = clock.simulate(step_time_s=0.1, payload_bytes=10**6, hidden_steps=10, **kw)
    assert hidden.comm_s == 0 and hidden.wallclock_s == pytest.approx(2.0)
    # streaming, 2 fragments of 1e6 and 2e6 B (2 (1 ms + P / 2e9 B/s): 3 and 4 ms), one sync
    # every 5 steps of 1 ms, each hidden behind tau = 2 steps (2 ms)
    st = clock.simulate(step_time_s=0.001, payload_bytes=[10**6, 2 * 10**6], fragments=2,
                        hidden_steps=2, **kw)  # fmt: skip
    # rounds 1..4 sync fragments 1, 0, 1, 0: stalls 4 - 2, 3 - 2, 4 - 2, 3 - 2 ms
    assert st.comm_s == pytest.approx(2 * (2e-3 + 1e-3))
    assert st.wallclock_s == pytest.approx(20 * 0.001 + st.comm_s)


@pytest.mark.parametrize("variant", [
    # the first carries the most state (~50 s): slow; eager's per-replica anchor (~30 s) is not
    pytest.param({"model.num_layers": 2, "outer.sync_every": 10, "streaming.fragments": 2,
                  "streaming.overlap": 2, "streaming.mix": 0.3, "compress.codec": "int4",
                  "compress.error_feedback": True, "compress.min_size": 64},
                 marks=pytest.mark.slow),
    {"outer.mode": "eager"},
    pytest.param({"compress.codec": "dct", "compress.min_size": 64}, marks=pytest.mark.slow),
], ids=["streaming_int4_ef", "eager", "dct"])  # fmt: skip
def test_resume_mid_run_is_bitwise_identical(variant, tmp_path):
    """The checkpoint holds every variant's state (fragment outer states, a fragment in flight,
    per-replica anchors, residuals, DCT momentum): a resumed run continues exactly."""

    from diloco_jax.train import train
    from tests.test_checkpoint import assert_bitwise_equal, tiny

    cfg = tiny(**variant)
    full = train(cfg, tmp_path / "full", show_progress=False)["state"]
    helpers.died_after(tmp_path / "full", 10, tmp_path / "cut")
    resumed = train(cfg, tmp_path / "cut", show_progress=False)
    assert resumed["steps"] == 20
    assert_bitwise_equal(resumed["state"], full)
