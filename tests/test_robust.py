"""Robust merging (``diloco_jax/algorithm/robust.py``, issue 63): each rule against a direct
NumPy computation, with weights and left-out (NaN) contributors; the exchange under ``vmap``
against the rule; the simulator against the mesh; the config's one-line errors."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax import config as config_lib
from diloco_jax.algorithm import diloco, optim, robust
from diloco_jax.algorithm.robust import Merge
from tests import helpers

R = 6
W_R = np.array([1.0, 2.0, 1.0, 3.0, 0.0, 1.0], np.float32)  # contributor 4 is left out
VALID_R = W_R > 0


def _leaves(seed=0):
    rng = np.random.default_rng(seed)
    leaves = [rng.normal(size=(R, 3, 4)).astype(np.float32), rng.normal(size=(R, 7))]
    leaves = [x.astype(np.float32) for x in leaves]
    leaves[0][2, 0, 0] = leaves[0][1, 0, 0]  # a tie: contributor order decides
    leaves[1][5] *= 50  # one far away
    for x in leaves:
        x[4] = np.nan  # the left-out contributor's values are never read
    return leaves


def _np_trimmed(values, weights, trim):
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    f = min(trim, (len(values) - 1) // 2)
    kept = order[f : len(values) - f]
    return sum(weights[i] * values[i] for i in kept) / sum(weights[i] for i in kept)


def _np_median(values, weights):
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    total, run, lo, hi = sum(weights), 0.0, None, None
    for i in order:
        run += weights[i]
        if lo is None and run >= total / 2:
            lo = values[i]
        if hi is None and run > total / 2:
            hi = values[i]
    return (lo + hi) / 2


def _coordinatewise(leaves, fn):
    out = []
    for x in leaves:
        flat = x.reshape(R, -1).astype(np.float64)
        got = []
        for j in range(flat.shape[1]):
            values = [flat[r, j] for r in range(R) if VALID_R[r]]
            got.append(fn(values, [float(W_R[r]) for r in range(R) if VALID_R[r]]))
        out.append(np.array(got).reshape(x.shape[1:]))
    return out


def _np_norms(leaves):
    return np.array([np.sqrt(sum(np.sum(x[r].astype(np.float64) ** 2) for x in leaves))
                     if VALID_R[r] else 0.0 for r in range(R)])  # fmt: skip


def _np_clip(leaves, clip):
    norms = _np_norms(leaves)
    radius = clip * np.median(norms[VALID_R])
    scale = np.where(norms > radius, radius / np.maximum(norms, 1e-30), 1.0)
    return [np.where(VALID_R.reshape(-1, *[1] * (x.ndim - 1)), x * scale.reshape(
        -1, *[1] * (x.ndim - 1)), np.nan) for x in leaves]  # fmt: skip


def _np_centered(leaves, center, radius, iterations):
    v = [c.astype(np.float64) for c in center]
    share = W_R / W_R.sum()
    for _ in range(iterations):
        diff = [x.astype(np.float64) - c[None] for x, c in zip(leaves, v, strict=True)]
        dist = np.array([np.sqrt(sum(np.sum(d[r] ** 2) for d in diff)) if VALID_R[r] else 0.0
                         for r in range(R)])  # fmt: skip
        tau = radius * np.median(dist[VALID_R])
        step = [share[r] * min(1.0, tau / dist[r]) if VALID_R[r] else 0.0 for r in range(R)]
        v = [c + sum(step[r] * d[r] for r in range(R) if VALID_R[r])
             for c, d in zip(v, diff, strict=True)]  # fmt: skip
    return v


def _reference(merge: Merge, leaves, center):
    if merge.clip:
        leaves = _np_clip(leaves, merge.clip)
    if merge.rule == "mean":
        return _coordinatewise(leaves, lambda v, w: np.dot(v, w) / sum(w))
    if merge.rule == "trimmed_mean":
        return _coordinatewise(leaves, lambda v, w: _np_trimmed(v, w, merge.trim))
    if merge.rule == "median":
        return _coordinatewise(leaves, _np_median)
    return _np_centered(leaves, center, merge.radius, merge.iterations)


CASES = {
    "mean, clipped": Merge("mean", clip=1.0),
    "trimmed_mean f=1": Merge("trimmed_mean", trim=1),
    "trimmed_mean f=9 (capped)": Merge("trimmed_mean", trim=9),
    "median": Merge("median"),
    "median, clipped": Merge("median", clip=2.0),
    "centered_clip": Merge("centered_clip", radius=1.0, iterations=3),
    "centered_clip, clipped": Merge("centered_clip", clip=1.5, radius=0.5, iterations=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rule_equals_a_direct_numpy_computation(name):
    merge = CASES[name]
    leaves = _leaves()
    center = [np.full(x.shape[1:], 0.25, np.float32) for x in leaves]
    got = robust.combine(merge, [jnp.asarray(x) for x in leaves], jnp.asarray(W_R),
                         jnp.asarray(VALID_R), [jnp.asarray(c) for c in center])  # fmt: skip
    want = _reference(merge, leaves, center)
    for g, w in zip(got, want, strict=True):
        assert np.all(np.isfinite(g)), name  # the NaN contributor was never read
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=1e-6, err_msg=name)


def test_the_robust_rules_resist_the_contributor_far_away_and_the_mean_does_not():
    leaves = _leaves()
    big = leaves[1]  # contributor 5 is 50 x the others there
    mean = robust.combine(Merge(), [jnp.asarray(x) for x in leaves], jnp.asarray(W_R),
                          jnp.asarray(VALID_R))[1]  # fmt: skip
    honest = np.abs(big[[0, 1, 2, 3]]).max()
    assert np.abs(np.asarray(mean)).max() > honest  # dragged out of the honest range
    for rule in ("trimmed_mean", "median", "centered_clip"):
        got = robust.combine(Merge(rule), [jnp.asarray(x) for x in leaves], jnp.asarray(W_R),
                             jnp.asarray(VALID_R))[1]  # fmt: skip
        assert np.abs(np.asarray(got)).max() <= honest, rule


def test_median_of_equal_weights_is_the_usual_median_and_ties_are_exact():
    x_R = jnp.asarray([[3.0], [1.0], [2.0], [10.0]])
    ones, every = jnp.ones(4), jnp.ones(4, bool)
    assert float(robust.weighted_median(x_R, ones, every)[0]) == 2.5
    assert float(robust.weighted_median(x_R[:3], ones[:3], every[:3])[0]) == 2.0
    # one contributor with most of the weight is the median, whatever the others say
    assert float(robust.weighted_median(x_R, jnp.asarray([1.0, 1, 1, 5]), every)[0]) == 10.0
    # nobody counted: zeros, not NaN
    assert float(robust.weighted_median(x_R, ones, jnp.zeros(4, bool))[0]) == 0.0
    assert float(robust.trimmed_mean(x_R, ones, jnp.zeros(4, bool), 1)[0]) == 0.0


@pytest.mark.parametrize("rule", ["trimmed_mean", "median", "centered_clip"])
def test_the_exchange_under_vmap_gives_every_replica_the_rules_merge(rule):
    merge = Merge(rule, clip=2.0)
    leaves = _leaves(1)
    ex = robust.exchange("replica", merge)
    state = jax.vmap(ex.init)([jnp.asarray(x) for x in leaves])
    finite_R = jnp.asarray(VALID_R)

    def one(delta, w, finite, center):
        return ex.mean(delta, w, finite, center)

    mean, (center, count), total_w = jax.vmap(one, axis_name="replica")(
        [jnp.asarray(x) for x in leaves], jnp.asarray(W_R), finite_R, state
    )
    want = robust.combine(merge, [jnp.asarray(x) for x in leaves], jnp.asarray(W_R), finite_R)
    for got, w in zip(mean, want, strict=True):
        for r in range(R):
            np.testing.assert_array_equal(np.asarray(got[r]), np.asarray(w))
    assert np.all(np.asarray(total_w) == W_R.sum()) and np.all(np.asarray(count) == 1)
    if rule == "centered_clip":  # the next sync starts from this one's merge
        for c, w in zip(center, want, strict=True):
            np.testing.assert_array_equal(np.asarray(c[0]), np.asarray(w))


@pytest.mark.parametrize(
    ("rule", "attack"),
    [("trimmed_mean", "alie"), ("median", "gaussian"), ("centered_clip", "inflate"),
     ("mean", "ipm")],
)  # fmt: skip
def test_simulator_equals_the_mesh_for_each_rule_with_an_attacker(rule, attack):
    """Two syncs of 4 replicas on the quadratic (each replica its own targets; replica 3's
    weight 3, replica 1 left out of the second sync; replica 2 hostile): the mesh of 2 devices
    x 2 virtual replicas computes the simulator's params, anchor and exchange state."""
    from tests.test_compress import LAYOUTS, run_quadratic

    hostile = robust.Attack(attack, (2,), seed=5)

    def tx(ax):
        return diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4, axis_name=ax,
                      merge=Merge(rule, clip=1.5), attack=hostile)  # fmt: skip

    weights = np.ones((9, 4))
    weights[:, 3] = 3.0
    weights[4:, 1] = 0.0
    sim = run_quadratic(tx, helpers.sim(4), 9, weights)
    mesh = run_quadratic(tx, LAYOUTS["2 devices x 2 virtual"], 9, weights)
    for got, want in [(mesh.params, sim.params), (mesh.anchor, sim.anchor),
                      (mesh.exchange_state, sim.exchange_state)]:  # fmt: skip
        chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)

    def mean(ax):
        return diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4, axis_name=ax)

    plain = run_quadratic(mean, helpers.sim(4), 9, weights)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), sim.anchor, plain.anchor)
    assert max(jax.tree.leaves(moved)) > 1e-3  # neither the rule nor the attack is a no-op


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"merge.rule": "krum"}, r"merge\.rule = 'krum' is invalid: must be one of"),
        ({"merge.clip": "-1"}, r"merge\.clip = -1\.0 is invalid"),
        ({"merge.iterations": "0"}, r"merge\.iterations = 0 is invalid"),
        (
            {"merge.rule": "median", "compress.codec": "int8"},
            r"merge\.rule = 'median' is invalid: .*does not combine with codecs",
        ),
        (
            {"merge.rule": "median", "algorithm": "ddp"},
            r"merge\.rule = 'median' is invalid: merges DiLoCo's",
        ),
        (
            {"sim.attack": "alie", "sim.attackers": "4", "parallel.replicas": "4"},
            r"sim\.attackers = 4 is invalid: must be in \[0, parallel\.replicas = 4\)",
        ),
        ({"sim.attack": "boom"}, r"sim\.attack = 'boom' is invalid: must be one of"),
        (
            {"sim.attack": "scale", "sim.attackers": "1", "compress.codec": "int8"},
            r"sim\.attack = 'scale' is invalid: .*does not combine with codecs",
        ),
    ],
)
def test_merge_config_errors_name_the_key(overrides, match):
    cfg = config_lib.load_preset("tiny")
    for key, value in overrides.items():
        cfg = config_lib.override(cfg, key, value)
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.validate(cfg)


def test_the_default_merge_is_the_plain_exchange():
    from diloco_jax.algorithm import exchange

    a = diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4, merge=Merge())
    b = diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4)
    # the same piece: the plain pmean, not a gather (so every bitwise test of the mean holds)
    assert a.exchange.mean.__qualname__ == b.exchange.mean.__qualname__
    assert a.exchange.mean.__qualname__.startswith(exchange.plain.__qualname__)


def _np_attacked(kind, leaves, s, hostile=(2,)):
    honest = [r for r in range(R) if VALID_R[r] and r not in hostile]
    out = []
    for x in leaves:
        x = x.astype(np.float64).copy()
        mu = x[honest].mean(axis=0)
        sigma = x[honest].std(axis=0)
        for h in hostile:
            x[h] = {"sign_flip": -s * x[h], "scale": s * x[h], "ipm": -s * mu,
                    "alie": mu - s * sigma}[kind]  # fmt: skip
        out.append(x)
    return out


@pytest.mark.parametrize("kind", ["sign_flip", "scale", "ipm", "alie"])
def test_each_attack_equals_a_direct_numpy_computation(kind):
    leaves = _leaves(2)
    attack = robust.Attack(kind, (2,))
    got, w = robust.attacked(attack, [jnp.asarray(x) for x in leaves], jnp.asarray(W_R),
                             jnp.asarray(VALID_R), jnp.asarray(0))  # fmt: skip
    want = _np_attacked(kind, leaves, robust.STRENGTH[kind])
    rows = [r for r in range(R) if VALID_R[r]]
    for g, x, honest in zip(got, want, leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g)[rows], x[rows], rtol=1e-5, atol=1e-6)
        assert not np.allclose(np.asarray(g)[2], honest[2])  # replaced
    np.testing.assert_array_equal(np.asarray(w), W_R)


def test_the_gaussian_attack_is_noise_around_its_own_and_the_inflater_only_weighs_more():
    leaves = _leaves(3)
    args = [jnp.asarray(x) for x in leaves], jnp.asarray(W_R), jnp.asarray(VALID_R)
    a0, _ = robust.attacked(robust.Attack("gaussian", (2,), seed=1), *args, jnp.asarray(0))
    a1, _ = robust.attacked(robust.Attack("gaussian", (2,), seed=1), *args, jnp.asarray(1))
    honest = [r for r in range(R) if VALID_R[r] and r != 2]
    flat = np.concatenate([x[honest].mean(axis=0).ravel() for x in leaves])
    rms = np.sqrt(np.mean(flat**2))
    noise = np.concatenate([(np.asarray(a) - x)[2].ravel()
                            for a, x in zip(a0, leaves, strict=True)])  # fmt: skip
    assert 5 * rms < noise.std() < 15 * rms  # strength 10 x the honest mean's RMS
    for a, x in zip(a0, leaves, strict=True):  # the others untouched
        np.testing.assert_array_equal(np.asarray(a)[honest], x[honest])
    assert not np.allclose(np.asarray(a1[0])[2], np.asarray(a0[0])[2])  # a new draw each sync
    same, w = robust.attacked(robust.Attack("inflate", (2, 4)), *args, jnp.asarray(0))
    np.testing.assert_array_equal(np.asarray(w), W_R * np.array([1, 1, 10, 1, 10, 1]))
    assert same[0] is args[0][0]  # its values are its own


def test_hostile_replicas_are_drawn_from_the_seed_alone():
    assert robust.hostile_replicas(8, 2, 0) == robust.hostile_replicas(8, 2, 0)
    assert len(set(robust.hostile_replicas(8, 3, 1))) == 3
    drawn = {robust.hostile_replicas(8, 1, seed) for seed in range(20)}
    assert len(drawn) > 3  # not always the same replica


def test_a_run_under_attack_keys_its_kept_program_by_the_seed_that_drew_its_attackers():
    from diloco_jax.run import programs

    cfg = config_lib.load_preset("tiny")
    assert "seed" in programs.free_keys(cfg)
    for key, value in {"sim.attack": "alie", "sim.attackers": "1"}.items():
        cfg = config_lib.override(cfg, key, value)
    assert "seed" not in programs.free_keys(cfg)  # another seed: other hostile replicas


def _pushes(rng, n=4):
    from diloco_jax.learners.rounds import Push

    leaves = [rng.normal(size=(n, 5, 3)).astype(np.float32), rng.normal(size=(n, 4))]
    leaves = [x.astype(np.float32) for x in leaves]
    leaves[0][3] *= 200.0  # a push far from the others
    weights = [1.0, 2.0, 1.0, 3.0]
    finite = [True, True, True, True]
    if n > 4:
        weights.append(1.0)
        finite.append(False)
        for x in leaves:
            x[4] = np.nan
    pushes = [Push(1, w, [x[r] for x in leaves], ok) for r, (w, ok) in enumerate(
        zip(weights, finite, strict=True))]  # fmt: skip
    return pushes, leaves, np.asarray(weights, np.float32), np.asarray(finite)


SYNCER_RULES = {
    "trimmed_mean": Merge("trimmed_mean", trim=1),
    "median": Merge("median"),
    "clipped_mean": Merge("mean", clip=1.0),
    "clipped_median": Merge("median", clip=1.5),
    "centered_clip": Merge("centered_clip", radius=1.0, iterations=3),
    "clipped_centered_clip": Merge("centered_clip", clip=1.5, radius=0.5, iterations=2),
}


@pytest.mark.parametrize("merge", SYNCER_RULES.values(), ids=SYNCER_RULES.keys())
def test_the_syncers_merge_with_each_rule_is_the_simulators_for_the_same_pushes(merge):
    """Five learners' pushes (one of them NaN, said not finite; one 200 x the others): the
    syncer's merge (leaf by leaf, the NaN push never read) against the simulator's exchange
    under vmap, each replica one of the pushes. The same jnp code on the same values; the
    exchange's is compiled into one program, so they agree to float32 rounding. Centered
    clipping starts from the same center (the last merge) in both, and returns the merge as
    the next one's."""
    from diloco_jax.learners.rounds import robust_merge

    rng = np.random.default_rng(4)
    pushes, leaves, w_R, finite_R = _pushes(rng, n=5)
    center = [rng.normal(size=x.shape[1:]).astype(np.float32) for x in leaves]
    mean, total_w, stats, following = robust_merge(pushes, merge, center=center)
    ex = robust.exchange("replica", merge)
    state = jax.vmap(ex.init)([jnp.asarray(x) for x in leaves])
    if merge.rule == "centered_clip":
        stacked = [
            jnp.broadcast_to(jnp.asarray(c), x.shape) for c, x in zip(center, leaves, strict=True)
        ]
        state = (stacked, state[1])
    w_sim = jnp.where(jnp.asarray(finite_R), jnp.asarray(w_R), 0.0)
    sim, _, _ = jax.jit(jax.vmap(ex.mean, axis_name="replica"))(
        [jnp.asarray(x) for x in leaves], w_sim, jnp.asarray(finite_R), state
    )
    for got, want in zip(mean, sim, strict=True):
        np.testing.assert_allclose(got, np.asarray(want[0]), rtol=1e-6, atol=1e-7)
    if merge.rule == "centered_clip":
        for got, want in zip(following, mean, strict=True):
            np.testing.assert_array_equal(got, want)
        far = robust_merge(pushes, merge, center=[c + 100.0 for c in center])[0]
        assert not np.allclose(far[0], mean[0])  # the center is read
    else:
        assert following is None
    assert total_w == 7.0
    assert len(stats["norm"]) == 4 and stats["norm"][3] > 50 * stats["norm"][0]
    if merge.clip:
        assert stats["clipped"][3] and not stats["clipped"][0]
    if merge.rule == "trimmed_mean":
        assert stats["trimmed"][3] > 0.5  # mostly at an end: 200 x the others


def test_a_syncer_merging_with_the_median_is_not_moved_by_one_far_push_and_says_so(tmp_path):
    """Three learners of a syncer whose algorithm merges with the median, one pushing 1000 x
    the others: the anchor moves by the median's outer step, as the rule on the pushes says;
    the round's tape line gives each push's norm, distance and whether it was trimmed."""
    from diloco_jax.learners import wire
    from tests.test_learners import _syncer

    algorithm = diloco(optax.adamw(0.05), optax.sgd(1.0), sync_every=3, merge=Merge("median"))
    x = {"w": np.zeros(3, np.float32)}
    pushed = [np.array([0.5, -1.0, 2.0], np.float32), np.array([0.25, -0.5, 1.0], np.float32),
              np.array([1000.0, 1000.0, -1000.0], np.float32)]  # fmt: skip
    syncer = _syncer(tmp_path, algorithm, learners=3)
    try:
        for i in range(3):
            syncer.join(i, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        for i in range(3):
            syncer.push(i, 1, 0, 1.0, {"['w']": pushed[i]})
        # outer SGD at lr 1: the anchor moves by minus the coordinate-wise median
        np.testing.assert_array_equal(np.asarray(syncer.anchor[0]), [-0.5, 0.5, -1.0])
        import json

        tape = [json.loads(line) for line in (tmp_path / "syncer" / "syncer.jsonl").open()]
        closed = [e for e in tape if e["event"] == "closed"][-1]
        assert closed["merge"]["rule"] == "median"
        norms = closed["merge"]["norm"]
        assert set(norms) == {"0", "1", "2"} and norms["2"] > 1000 * norms["1"]
        assert closed["merge"]["distance"]["2"] > 1000
    finally:
        syncer.close()


def _centered_pushes(rounds: int) -> list[list[np.ndarray]]:
    """Three learners' pushes of 6 values for each of ``rounds`` rounds, learner 2's far from
    the others (centered clipping's case)."""
    rng = np.random.default_rng(63)
    out = []
    for _ in range(rounds):
        values = rng.normal(size=(3, 6)).astype(np.float32)
        values[2] *= 40.0
        out.append([values[i] for i in range(3)])
    return out


def _centered_syncer_run(workdir, algorithm, pushed, restart_after=None) -> list[np.ndarray]:
    """A syncer of three learners over a model ``{"a": [2], "b": [4]}`` merging ``pushed`` (by
    round, by learner: 6 values split into the leaves), closed and started again from its
    checkpoint after round ``restart_after``; the anchor after each round, flat."""
    from diloco_jax.learners import wire
    from tests.test_learners import _syncer

    x = {"a": np.zeros(2, np.float32), "b": np.zeros(4, np.float32)}
    syncer = _syncer(workdir, algorithm, learners=3)
    anchors = []
    try:
        for i in range(3):
            syncer.join(i, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        for rnd, values in enumerate(pushed):
            for i, v in enumerate(values):
                syncer.push(i, 1, rnd, 1.0, {"['a']": v[:2], "['b']": v[2:]})
            anchors.append(np.concatenate([np.asarray(a) for a in syncer.anchor]))
            if rnd == restart_after:
                syncer.close()
                syncer = _syncer(workdir, algorithm, learners=3)
    finally:
        syncer.close()
    return anchors


def test_a_syncer_clips_around_its_last_merge_as_the_simulator_does_across_a_restart(tmp_path):
    """Centered clipping at the syncer (issue 63): three learners, one far off, four rounds.
    Each round's anchor (outer SGD at lr 1: minus the sum of the merges) is the simulator's
    exchange's over the same pushes, whose center is its last merge; a syncer restarted after
    round 1 restores the center from its checkpoint and goes on with the same bits as one that
    was not restarted. With the center not carried (zeros each round) round 1 would differ."""
    merge = Merge("centered_clip", radius=1.0, iterations=2)
    algorithm = diloco(optax.adamw(0.05), optax.sgd(1.0), sync_every=3, merge=merge)
    pushed = _centered_pushes(4)
    straight = _centered_syncer_run(tmp_path / "a", algorithm, pushed)
    restarted = _centered_syncer_run(tmp_path / "b", algorithm, pushed, restart_after=1)
    for a, b in zip(straight, restarted, strict=True):
        np.testing.assert_array_equal(a, b)
    ex = robust.exchange("replica", merge)
    step = jax.jit(jax.vmap(ex.mean, axis_name="replica"))

    def leaves(values):
        return [jnp.asarray(np.stack([v[:2] for v in values])),
                jnp.asarray(np.stack([v[2:] for v in values]))]  # fmt: skip

    def merged_of(values, state):
        out, state, _ = step(leaves(values), jnp.ones(3), jnp.ones(3, bool), state)
        return np.concatenate([np.asarray(m[0]) for m in out]), state

    state = jax.vmap(ex.init)(leaves(pushed[0]))
    anchor = np.zeros(6, np.float32)
    for rnd, values in enumerate(pushed):
        merged, state = merged_of(values, state)
        anchor = anchor - merged
        np.testing.assert_allclose(straight[rnd], anchor, rtol=1e-5, atol=1e-6)
    fresh = jax.vmap(ex.init)(leaves(pushed[1]))  # round 1 clipped around zeros instead
    forgot = straight[0] - merged_of(pushed[1], fresh)[0]
    assert np.abs(straight[1] - forgot).max() > 1e-3
