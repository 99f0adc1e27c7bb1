"""Independent learners and a syncer (issue 41): the wire format, the syncer's rounds against
the core's own sync, refusals, and learners trained by ``python -m diloco_jax.train`` against
the mesh runtime."""

import json
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import diloco, init_replicas, vmap_axes
from diloco_jax.learners import identity, service, wire
from diloco_jax.learners.syncer import Refused, Syncer
from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOKEN = "learners-test-token"
CENTERS_RxD = np.array([[1.0, -2.0, 0.5], [3.0, 0.5, -1.0], [-1.0, 2.0, 0.0],
                        [0.5, 0.5, 4.0]], np.float32)  # fmt: skip


def _credential(learner: int) -> str:
    return identity.learner_credential(TOKEN, learner)


def _algorithm(outer_mode: str = "sync"):
    return diloco(optax.adamw(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=3,
                  outer_mode=outer_mode)  # fmt: skip


def _syncer(tmp_path, algorithm, learners=4, **kw):
    kw = {"timeout": 30.0, "dead_after": 30.0, **kw}
    return Syncer(algorithm, tmp_path / "syncer", keys={"outer.sync_every": 3},
                  learners=learners, **kw)  # fmt: skip


# ---- the wire ------------------------------------------------------------------------------


def test_a_message_round_trips_and_a_damaged_one_is_refused_by_name():
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float16)}
    arrays = wire.named(tree)
    chunks = list(wire.encode({"round": 3}, arrays))
    fields, back = wire.decode(chunks, max_bytes=1 << 20)
    assert fields == {"round": 3}
    chex.assert_trees_all_equal(wire.unnamed(tree, back), tree)
    assert back["['b']"].dtype == np.float16
    with pytest.raises(wire.WireError, match="truncated message: 12 of 30 bytes"):
        wire.decode([chunks[0], chunks[1][:12]], max_bytes=1 << 20)
    with pytest.raises(wire.WireError, match="30 bytes, more than the limit of 29"):
        wire.decode(chunks, max_bytes=29)
    damaged = chunks[1][:-1] + bytes([chunks[1][-1] ^ 1])
    with pytest.raises(wire.WireError, match="do not match its checksum"):
        wire.decode([chunks[0], damaged], max_bytes=1 << 20)
    other = {"w": np.zeros((3, 2), np.float32), "b": np.ones(3, np.float16)}
    with pytest.raises(wire.WireError, match=r"parameter \['w'\] is \[2, 3\] float32, expected "
                       r"\[3, 2\] float32"):  # fmt: skip
        wire.unnamed(other, back)


@pytest.mark.parametrize("name", ["none", "bf16", "int8", "fp8", "int4", "topk"])
def test_a_push_travels_through_the_cores_codec_and_costs_the_simulators_payload(name):
    """A learner's push, encoded with ``compress.codec``: a leaf under ``min_size`` stays
    float32; the rest decode to the core's own code of their concatenation (blockwise: the
    core's round trip on whole blocks; topk: the k largest values where they were, two
    replicas' worth). Its bytes are ``comms.push_payload``. A damaged one is refused, named."""
    from diloco_jax.algorithm import compress
    from diloco_jax.learners import payload
    from diloco_jax.simulated import comms

    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(40, 30)).astype(np.float32), "b": np.ones(7, np.float32),
            "c": rng.normal(size=500).astype(np.float32)}  # fmt: skip
    codec = compress.Codec(name, block=64, topk_fraction=0.05, min_size=100)
    names, leaves = wire.leaf_names(tree), jax.tree.leaves(tree)
    described = wire.describe(tree)
    message = payload.encode(names, leaves, codec, replicas=2)
    assert payload.push_bytes(message) == comms.push_payload(tree, codec, replicas=2)
    got = dict(zip(names, payload.decode(described, message, codec), strict=True))
    np.testing.assert_array_equal(got["['b']"], tree["b"])
    flat = np.concatenate([tree["a"].ravel(), tree["c"].ravel()])
    back = np.concatenate([got["['a']"].ravel(), got["['c']"].ravel()])
    if name == "topk":
        keep = np.argsort(-np.abs(flat))[: 2 * compress.topk_count(flat.size, 0.05)]
        want = np.zeros_like(flat)
        want[keep] = flat[keep]
    else:
        padded = np.pad(flat, (0, -flat.size % 64)).reshape(-1, 64)
        want = np.asarray(compress.roundtrip(jnp.asarray(padded), name)).ravel()[: flat.size]
    np.testing.assert_array_equal(back, want)
    if name == "none":
        return
    key = "codec/positions" if name == "topk" else "codec/0"
    with pytest.raises(wire.WireError, match=f"the push lacks {key}"):
        payload.decode(described, {k: v for k, v in message.items() if k != key}, codec)
    cut = {**message, key: message[key][:-1]}
    with pytest.raises(wire.WireError, match=f"{key} is"):
        payload.decode(described, cut, codec)
    if name == "topk":
        positions = message[key].copy()
        positions[1] = positions[0]
        with pytest.raises(wire.WireError, match="sent twice"):
            payload.decode(described, {**message, key: positions}, codec)
        positions[1] = flat.size
        with pytest.raises(wire.WireError, match="outside"):
            payload.decode(described, {**message, key: positions}, codec)


# ---- the syncer's rounds against the core's own sync ---------------------------------------


def _learner_fns(algorithm):
    axes = vmap_axes(algorithm)
    contribute = jax.jit(jax.vmap(algorithm.contribution, in_axes=(axes,), out_axes=(axes, 0, 0),
                                  axis_name="replica"))  # fmt: skip
    restart = jax.jit(jax.vmap(algorithm.restart, in_axes=(axes, None), out_axes=axes))
    local = jax.jit(jax.vmap(lambda s, g: algorithm.update(s, g, sync=False), in_axes=(axes, 0),
                             out_axes=(axes, 0), axis_name="replica"))  # fmt: skip
    return contribute, restart, local


@pytest.mark.parametrize("mode", ["sync", "eager"])
def test_four_learners_through_a_syncer_equal_four_replicas_of_the_core(tmp_path, mode):
    """Each learner holds one replica of a quadratic and takes inner steps alone; at each sync
    it pushes its pseudo-gradient and restarts from the syncer's anchor. After 4 rounds the
    anchor, every replica's parameters and AdamW states equal the core's vmap over 4 replicas
    (the same float32 sums: bitwise here). The syncer's tape shows each round closed by all
    four, and its checkpoint holds the last round's anchor.

    Eager: the syncer answers with the round's mean; each learner takes its own outer step on
    the mean of the round before, with its share of this round's (its pseudo-gradient over
    the four learners') in place of its share of that one: each replica's anchor, parameters
    and outer state are the core's eager replicas', bitwise."""
    algorithm, x0 = _algorithm(mode), jnp.zeros(3, jnp.float32)
    _, want, _ = helpers.run_vmapped(algorithm, x0, CENTERS_RxD, 12)
    contribute, restart, local = _learner_fns(algorithm)
    land = jax.jit(jax.vmap(lambda s, m: algorithm.land_mean(s, m, 4), in_axes=(vmap_axes(
        algorithm), None), out_axes=vmap_axes(algorithm), axis_name="replica"))  # fmt: skip
    syncer = _syncer(tmp_path, algorithm, answer_mean=mode == "eager")
    states = [init_replicas(algorithm, x0, 1) for _ in range(4)]
    before = jnp.zeros_like(x0)  # eager: the mean of the round before (none at the first)
    try:
        for i in range(4):
            gen, rnd, anchor = syncer.join(i, wire.describe(x0),
                                           {"outer.sync_every": 3}, wire.named(x0))  # fmt: skip
            assert (gen, rnd) == (1, 0)
        for rnd in range(4):
            pushed = []
            for i in range(4):
                for _ in range(3):
                    grads = states[i].params - CENTERS_RxD[i : i + 1]
                    states[i], _ = local(states[i], grads)
                states[i], mean, total_w = contribute(states[i])
                pushed.append(mean)
                leaves = [np.asarray(m[0]) for m in mean]
                named = dict(zip(wire.leaf_names(x0), leaves, strict=True))
                syncer.push(i, 1, rnd, float(total_w[0]), named)
            assert syncer.round == rnd + 1
            got_round, answer = syncer.wait(rnd, 1.0)
            if mode == "eager":
                states = [land(s, before) for s in states]
                before = wire.unnamed(x0, answer)
                continue
            new_anchor = wire.unnamed(x0, answer)
            states = [restart(s, new_anchor) for s in states]
        for i, state in enumerate(states):
            if mode == "eager":  # each learner's own anchor and outer state
                chex.assert_trees_all_equal(state.anchor[0], want.anchor[i])
                chex.assert_trees_all_equal(
                    jax.tree.map(lambda x: x[0], state.outer_state),
                    jax.tree.map(lambda x, i=i: x[i], want.outer_state),
                )
            else:
                chex.assert_trees_all_equal(state.anchor, want.anchor)
            chex.assert_trees_all_equal(state.params[0], want.params[i])
            mine = jax.tree.map(lambda x: x[0], state.inner_state)
            chex.assert_trees_all_equal(mine, jax.tree.map(lambda x, i=i: x[i], want.inner_state))
    finally:
        syncer.close()
    tape = [json.loads(x) for x in (tmp_path / "syncer" / "syncer.jsonl").read_text().splitlines()]
    closed = [e for e in tape if e["event"] == "closed"]
    assert [e["closed"] for e in closed] == [0, 1, 2, 3]
    assert all(e["learners"] == [0, 1, 2, 3] for e in closed)
    again = _syncer(tmp_path, algorithm)  # a restarted syncer: from its last round
    try:
        assert again.round == 4
        assert {i: m.generation for i, m in again.members.items()} == {0: 1, 1: 1, 2: 1, 3: 1}
        if mode == "sync":
            np.testing.assert_array_equal(again.anchor[0], np.asarray(want.anchor))
        chex.assert_trees_all_equal(again.outer_state, syncer.outer_state)
    finally:
        again.close()


def _fragment_of(params, count: int) -> list[int]:  # leaf i in fragment i mod F
    return [i % count for i in range(len(jax.tree.leaves(params)))]


@pytest.mark.parametrize(("fragments", "overlap", "rule"),
                         [(2, 0, "mean"), (4, 0, "mean"), (2, 1, "mean"),
                          (2, 0, "centered_clip")])  # fmt: skip
def test_streaming_learners_through_a_syncer_equal_the_cores_streaming_replicas(
        tmp_path, fragments, overlap, rule):  # fmt: skip
    """Streaming DiLoCo between learners: each of four learners (one replica each) syncs every
    ``sync_every / F`` steps, pushing the fragment the core's plan starts there (its leaves
    alone: over F rounds every leaf is pushed, and answered, once); the syncer takes that
    fragment's outer step with its own outer state, and each learner lands the answer mixed
    (``mix`` 0.25). After three rounds of every fragment, the anchor, every replica's
    parameters, inner and exchange states and the syncer's outer state (one per fragment, also
    as a restarted syncer reads it back) equal the core's streaming vmap over four replicas,
    bitwise: the same float32 operations on the same values (the syncer's merge of four equal
    weights is the core's mean, as in the plain rounds). With an overlap tau the answer lands
    tau steps after its sync, while the learner trains on (``Learner.land``), as the core's
    landing does. Merged by centered clipping (issue 63), each fragment's center is its own
    last merge at the syncer, as in the core's exchange state: equal to float32 rounding (the
    core's merge is compiled into its step, the syncer's is not)."""
    from functools import partial

    from diloco_jax.algorithm import fragments as fragments_lib
    from diloco_jax.algorithm.robust import Merge
    from diloco_jax.learners.learner import _sync_parts

    algorithm = diloco(optax.adamw(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True),
                       sync_every=4, streaming=(fragments, overlap, 0.25),
                       fragment_of=_fragment_of,
                       merge=Merge(rule, radius=1.0, iterations=2))  # fmt: skip
    same = (chex.assert_trees_all_equal if rule == "mean"
            else partial(chex.assert_trees_all_close, rtol=1e-5, atol=1e-6))  # fmt: skip
    x0 = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2)), "c": jnp.zeros(4), "d": jnp.zeros(5)}
    rng = np.random.default_rng(0)
    targets_R = jax.tree.map(lambda x: np.asarray(rng.normal(size=(4, *x.shape)), np.float32), x0)
    period, syncs = 4 // fragments, 3 * fragments
    _, want, _ = helpers.run_vmapped(algorithm, x0, targets_R, syncs * period + overlap)
    _, _, local = _learner_fns(algorithm)
    parts = [_sync_parts(algorithm, None, 1, None, f)[:2] for f in range(fragments)]
    names, assignment = wire.leaf_names(x0), _fragment_of(x0, fragments)
    syncer = _syncer(tmp_path, algorithm)
    states = [init_replicas(algorithm, x0, 1) for _ in range(4)]
    sent, model = [], sum(x.nbytes for x in jax.tree.leaves(x0))
    try:
        for i in range(4):
            syncer.join(i, wire.describe(x0), {"outer.sync_every": 3}, wire.named(x0),
                        assignment)  # fmt: skip
        with pytest.raises(Refused, match=r"\['a'\] is in streaming fragment 1, the syncer's 0"):
            syncer.join(0, wire.describe(x0), {"outer.sync_every": 3}, wire.named(x0),
                        [1] * 4)  # fmt: skip
        other = {n: np.zeros(np.shape(x0[n[2]]), np.float32)  # round 0's is fragment 1
                 for n, g in zip(names, assignment, strict=True) if g == 0}  # fmt: skip
        with pytest.raises(Refused, match="the push lacks"):
            syncer.push(0, 1, 0, 1.0, other)
        landing = None  # with an overlap: (fragment's leaf names, its answer) in flight
        for rnd in range(syncs + (overlap > 0)):  # then the last landing's steps
            for i in range(4):
                for k in range(overlap if rnd == syncs else period):
                    target = jax.tree.map(lambda t, i=i: t[i : i + 1], targets_R)
                    states[i], _ = local(states[i], jax.tree.map(jnp.subtract, states[i].params,
                                                                 target))  # fmt: skip
                    if landing is not None and k + 1 == overlap:  # tau steps after its sync
                        g, names_g, answer_g = landing
                        states[i] = parts[g][1](states[i], [answer_g[n] for n in names_g])
            landing = None
            if rnd == syncs:
                break
            f = algorithm.plan.round_fragment(rnd)
            assert f == (rnd + 1) % fragments  # the plan's first sync is fragment 1's
            mine = [n for n, g in zip(names, assignment, strict=True) if g == f]
            for i in range(4):
                states[i], mean, total_w = parts[f][0](states[i])
                pushed = dict(zip(mine, (np.asarray(m) for m in mean), strict=True))
                syncer.push(i, 1, rnd, float(total_w), pushed)
            sent.append(sum(a.nbytes for a in pushed.values()))
            assert syncer.round == rnd + 1
            _, answer = syncer.wait(rnd, 1.0)
            assert list(answer) == mine  # the fragment's anchor alone
            if overlap:
                landing = (f, mine, answer)
            else:
                states = [parts[f][1](s, [answer[n] for n in mine]) for s in states]
        for i, state in enumerate(states):
            same(state.anchor, want.anchor)
            fields = ("params", "inner_state") + ("exchange_state",) * (rule == "mean")
            for field in fields:
                same(jax.tree.map(lambda x: x[0], getattr(state, field)),
                     jax.tree.map(lambda x, i=i: x[i], getattr(want, field)))  # fmt: skip
        same(syncer.outer_state, want.outer_state)
        if rule != "mean":  # the syncer's centers: each fragment's, the core's exchange state
            for f, idx in enumerate(fragments_lib.groups(assignment, fragments)):
                same(
                    [syncer.center[j] for j in idx],
                    jax.tree.map(lambda x: x[0], want.exchange_state[f][0]),
                )
    finally:
        syncer.close()
    assert sum(sent[:fragments]) == model and max(sent) < model / fragments * 1.5
    again = _syncer(tmp_path, algorithm)  # a restarted syncer: its fragments' outer states
    try:
        assert again.round == syncs and again.assignment == assignment
        chex.assert_trees_all_equal(again.outer_state, syncer.outer_state)
        if rule != "mean":
            chex.assert_trees_all_equal(again.center, syncer.center)
    finally:
        again.close()


def test_weighed_rounds_move_the_anchor_by_the_examples_merged(tmp_path):
    """``syncer.weigh_rounds``: after a round of both learners (whole weights 4 and 4), a round
    where only learner 0 pushed (half a full round's examples) takes the outer step on half its
    mean, as a syncer that does not weigh rounds fed that half; the round of both is unchanged,
    bit for bit."""
    x = {"w": np.zeros(3, np.float32)}
    first = [np.array([0.5, -1.25, 3.0], np.float32), np.array([1.0, 0.25, -2.0], np.float32)]
    second = np.array([-0.75, 2.0, 0.125], np.float32)
    anchors = []
    for weighed, pushed in [(True, second), (False, second * np.float32(0.5))]:
        syncer = _syncer(tmp_path / str(weighed), _algorithm(), learners=2, weigh_rounds=weighed)
        try:
            for i in range(2):
                syncer.join(i, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
            for i in range(2):
                syncer.push(i, 1, 0, 4.0, {"['w']": first[i]})
            anchors.append(syncer.anchor[0])
            syncer.leave(1, 1)
            syncer.push(0, 1, 1, 4.0, {"['w']": pushed})
            assert syncer.round == 2 and syncer.full_round() == 8.0
            anchors.append(syncer.anchor[0])
        finally:
            syncer.close()
    np.testing.assert_array_equal(anchors[0], anchors[2])  # a full round: unchanged
    np.testing.assert_array_equal(anchors[1], anchors[3])  # half a round: half the mean


def test_the_syncer_refuses_what_does_not_fit_and_leaves_a_bad_push_out(tmp_path):
    algorithm = _algorithm()
    x = {"w": np.zeros(3, np.float32)}
    syncer = _syncer(tmp_path, algorithm, learners=2, timeout=0.2, dead_after=30.0)
    try:
        syncer.join(0, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        with pytest.raises(Refused, match="outer.sync_every is 5 on learner 1 but 3 on the syncer"):
            syncer.join(1, wire.describe(x), {"outer.sync_every": 5}, wire.named(x))
        other = {"w": np.zeros(4, np.float32)}
        with pytest.raises(Refused, match=r"parameter \['w'\] is \[4\] float32, expected \[3\]"):
            syncer.join(1, wire.describe(other), {"outer.sync_every": 3}, wire.named(other))
        with pytest.raises(Refused, match=r"learner 2 is not in \[0, 2\)"):
            syncer.join(2, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        syncer.join(1, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        nan = {"['w']": np.array([np.nan, 0, 0], np.float32)}
        syncer.push(1, 1, 0, 1.0, nan)  # left out of the round
        syncer.push(0, 1, 0, 1.0, {"['w']": np.array([1.0, 1.0, 1.0], np.float32)})
        assert syncer.round == 1
        moved = syncer.anchor[0]
        # Nesterov's first update: -0.7 * (1 + 0.9) * mean, the mean of the finite push alone
        np.testing.assert_allclose(moved, np.full(3, -0.7 * 1.9), rtol=1e-6)
        with pytest.raises(Refused, match="stale: computed against round 0, the syncer is at "
                           "round 1"):  # fmt: skip
            syncer.push(0, 1, 0, 1.0, {"['w']": np.ones(3, np.float32)})
        with pytest.raises(Refused, match="generation 7 is not a member"):
            syncer.push(0, 7, 1, 1.0, {"['w']": np.ones(3, np.float32)})
        # a round whose deadline passes drops the silent learner and closes without it
        syncer.push(0, 1, 1, 1.0, {"['w']": np.ones(3, np.float32)})
        assert syncer.round == 1
        rnd, _ = syncer.wait(1, 5.0)
        assert rnd == 2 and syncer.members[1].status == "dropped"
        with pytest.raises(Refused, match="learner 1 was dropped: join again"):
            syncer.push(1, 1, 2, 1.0, {"['w']": np.ones(3, np.float32)})
    finally:
        syncer.close()
    events = [json.loads(x)["event"] for x in (tmp_path / "syncer" / "syncer.jsonl").open()]
    assert "not_finite" in events and "dropped" in events and "refused" in events


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _beat(syncer, learner):
    """A heartbeat, then the close it may have set off (off the lock) settled."""
    syncer.heartbeat(learner, 1)
    syncer.tick()


def _ones(v):
    return {"['w']": np.full(3, v, np.float32)}


def _nesterov(x, means):
    """Each round's anchor by optax itself: x + update(mean) with SGD 0.7, Nesterov 0.9."""
    opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
    state, out = opt.init(x), []
    for m in means:
        update, state = opt.update(m, state)
        x = x + update
        out.append(x)
    return out


@pytest.mark.parametrize("late_weight", [1.0, 0.5])
def test_quorum_rounds_wait_the_grace_then_merge_a_late_push_by_its_weight(tmp_path, late_weight):
    """Quorum 2 of 3, grace 1 s (fixed), on a test clock: a round with two pushes closes when the
    grace has passed, not before; the third learner's push, computed against round 0, is late:
    it joins round 1 with its weight but does not count towards round 1's quorum; round 1's
    mean weighs it by its examples (times ``syncer.late_weight``: 2 x 0.5 = 1 in the second
    case). Pushes more than ``max_late`` rounds late are refused as stale."""
    clock, x = _Clock(), {"w": np.zeros(3, np.float32)}
    syncer = _syncer(tmp_path, _algorithm(), learners=3, quorum=2, grace=1.0,
                     adaptive_grace=False, max_late=1, late_weight=late_weight,
                     clock=clock)  # fmt: skip
    try:
        for i in range(3):
            syncer.join(i, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        clock.t = 1.0
        assert syncer.push(0, 1, 0, 1.0, _ones(1.0)) == 0
        clock.t = 1.5
        syncer.push(1, 1, 0, 1.0, _ones(2.0))  # the quorum: the grace runs to t = 2.5
        clock.t = 2.4
        _beat(syncer, 2)
        assert syncer.round == 0
        clock.t = 2.6
        _beat(syncer, 2)
        assert syncer.round == 1 and syncer.members[2].status == "present"
        assert syncer.push(2, 1, 0, 2.0, _ones(4.0)) == 1  # late: into round 1
        syncer.push(0, 1, 1, 1.0, _ones(1.0))
        clock.t = 5.0
        _beat(syncer, 0)
        assert syncer.round == 1  # one push on time and a late one: no quorum yet
        syncer.push(1, 1, 1, 1.0, _ones(1.0))  # all three in round 1: it closes now
        assert syncer.round == 2
        late_mean = (1 + 1 + 2 * late_weight * 4) / (2 + 2 * late_weight)  # 2.5, or 2.0
        want = _nesterov(np.zeros(3, np.float32), [np.full(3, 1.5, np.float32),
                                                   np.full(3, late_mean, np.float32)])  # fmt: skip
        np.testing.assert_allclose(syncer.anchor[0], want[1], rtol=1e-6)
        assert syncer.members[2].late == 1
        for i in (0, 1):
            syncer.push(i, 1, 2, 1.0, _ones(1.0))
        clock.t = 10.0
        _beat(syncer, 0)
        syncer.push(0, 1, 3, 1.0, _ones(1.0))
        with pytest.raises(Refused, match=r"stale: .* round 1, the syncer is at round 3 \(more "
                           "than syncer.max_late = 1 rounds behind"):  # fmt: skip
            syncer.push(2, 1, 1, 1.0, _ones(1.0))
    finally:
        syncer.close()
    closed = [json.loads(x) for x in (tmp_path / "syncer" / "syncer.jsonl").open()]
    closed = [e for e in closed if e["event"] == "closed"]
    assert [e["why"] for e in closed] == ["quorum and 1.00s of grace", "all pushed",
                                          "quorum and 1.00s of grace"]  # fmt: skip
    assert closed[1]["late"] == [2] and closed[1]["weights"] == [1.0, 1.0, 2.0]


def test_the_adaptive_grace_waits_for_learners_that_come_together_not_for_a_straggler(tmp_path):
    """Grace at most 4 s, adaptive: round 0 (no history) waits up to 4 s and learner 2 comes
    0.2 s after the quorum; from then the window is 1.5 x 0.2 s, floored at 0.1 x 4 s = 0.4 s,
    so a round whose third learner is 1 s late closes 0.4 s after its quorum."""
    clock, x = _Clock(), {"w": np.zeros(3, np.float32)}
    syncer = _syncer(tmp_path, _algorithm(), learners=3, quorum=2, grace=4.0, clock=clock)
    try:
        for i in range(3):
            syncer.join(i, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        syncer.push(0, 1, 0, 1.0, _ones(1.0))
        syncer.push(1, 1, 0, 1.0, _ones(1.0))
        assert syncer.status()["grace_in_force"] == 4.0
        clock.t = 0.2
        syncer.push(2, 1, 0, 1.0, _ones(1.0))
        assert syncer.round == 1 and syncer.status()["grace_in_force"] == 0.4
        clock.t = 1.0
        syncer.push(0, 1, 1, 1.0, _ones(1.0))
        syncer.push(1, 1, 1, 1.0, _ones(1.0))
        clock.t = 1.39
        _beat(syncer, 2)
        assert syncer.round == 1
        clock.t = 1.41
        _beat(syncer, 2)
        assert syncer.round == 2 and syncer.members[2].status == "present"
        assert syncer.push(2, 1, 1, 1.0, _ones(1.0)) == 1
    finally:
        syncer.close()


def test_a_syncer_with_an_examples_budget_finishes_once_it_is_merged(tmp_path):
    """``syncer.examples = 5``: rounds merging 2 then 4 examples; the second finishes the run
    (6 >= 5), a later push changes nothing, and a restarted syncer is still finished."""
    x = {"w": np.zeros(3, np.float32)}
    syncer = _syncer(tmp_path, _algorithm(), learners=2, examples=5.0)
    try:
        for i in (0, 1):
            syncer.join(i, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        for i in (0, 1):
            syncer.push(i, 1, 0, 1.0, _ones(1.0))
        assert syncer.round == 1 and not syncer.finished
        for i in (0, 1):
            syncer.push(i, 1, 1, 2.0, _ones(1.0))
        assert syncer.round == 2 and syncer.finished and syncer.merged == 6.0
        anchor = np.array(syncer.anchor[0])
        assert syncer.push(0, 1, 2, 2.0, _ones(5.0)) == 0
        np.testing.assert_array_equal(syncer.anchor[0], anchor)
    finally:
        syncer.close()
    again = _syncer(tmp_path, _algorithm(), learners=2, examples=5.0)
    try:
        assert again.finished and again.merged == 6.0
    finally:
        again.close()


def test_a_learner_joining_while_a_round_is_open_joins_the_next_round(tmp_path):
    """A synchronous run's first round waits for every declared learner: learner 2, not yet
    joined, is waited for and its join returns at once, in round 0. Later rounds do not wait for
    a joiner: learner 2 leaves, joins again while round 1 is open, and its join returns once
    learners 0 and 1 have closed round 1, with the new anchor and round."""
    import threading

    x = {"w": np.zeros(3, np.float32)}
    syncer = _syncer(tmp_path, _algorithm(), learners=3)

    def join(i):
        return syncer.join(i, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))

    try:
        for i in (0, 1):
            join(i)
        for i in (0, 1):
            syncer.push(i, 1, 0, 1.0, _ones(1.0))
        assert syncer.round == 0 and syncer.status()["waiting_for"] == [2]
        assert join(2)[:2] == (1, 0)  # in round 0 at once
        syncer.push(2, 1, 0, 1.0, _ones(1.0))
        assert syncer.round == 1
        syncer.leave(2, 1)
        syncer.push(0, 1, 1, 1.0, _ones(1.0))
        joined = {}
        joiner = threading.Thread(target=lambda: joined.update(r=join(2)))
        joiner.start()
        joiner.join(0.3)
        assert joiner.is_alive() and syncer.round == 1  # round 1 still waits for learner 1 only
        syncer.push(1, 1, 1, 1.0, _ones(1.0))
        joiner.join(5.0)
        generation, rnd, anchor = joined["r"]
        assert (generation, rnd) == (2, 2)
        np.testing.assert_array_equal(anchor["['w']"], syncer.anchor[0])
        assert syncer.status()["members"][2]["joined_round"] == 1
    finally:
        syncer.close()


def test_a_killed_learner_is_dropped_the_round_goes_on_and_its_restart_rejoins(tmp_path):
    """The stand-in of the chaos tests, on a test clock: learner 1 dies mid-round (no push, no
    heartbeat); once silent for ``dead_after`` it is dropped and the round closes with learner 0
    alone; its restart joins again with a new generation and the next round waits for it; a
    late push of the dead generation is refused and changes nothing."""
    clock, x = _Clock(), {"w": np.zeros(3, np.float32)}
    syncer = _syncer(tmp_path, _algorithm(), learners=2, dead_after=5.0, clock=clock)
    try:
        for i in (0, 1):
            syncer.join(i, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        syncer.push(0, 1, 0, 1.0, _ones(1.0))
        clock.t = 4.9
        _beat(syncer, 0)
        assert syncer.round == 0 and syncer.members[1].status == "present"
        clock.t = 5.1
        _beat(syncer, 0)
        assert syncer.round == 1 and syncer.members[1].status == "dropped"
        generation, rnd, _ = syncer.join(1, wire.describe(x), {"outer.sync_every": 3},
                                         wire.named(x))  # fmt: skip
        assert (generation, rnd) == (2, 1)
        with pytest.raises(Refused, match="learner 1 generation 1 is not a member"):
            syncer.push(1, 1, 1, 1.0, _ones(9.0))
        syncer.push(0, 1, 1, 1.0, _ones(1.0))
        assert syncer.round == 1 and syncer.status()["waiting_for"] == [1]
        syncer.push(1, 2, 1, 1.0, _ones(3.0))
        assert syncer.round == 2
        want = _nesterov(np.zeros(3, np.float32), [np.full(3, 1.0, np.float32),
                                                   np.full(3, 2.0, np.float32)])  # fmt: skip
        np.testing.assert_allclose(syncer.anchor[0], want[1], rtol=1e-6)
    finally:
        syncer.close()


def test_over_grpc_a_wrong_token_is_unauthenticated_and_changes_nothing(tmp_path):
    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    x = {"w": np.zeros(3, np.float32)}
    fields = {"learner": 0, "describe": wire.describe(x), "keys": {"outer.sync_every": 3}}
    try:
        # a malformed one, and a well-formed one made with another secret (forged)
        for bad in ("not-the-token", identity.learner_credential("another-secret", 0)):
            wrong = service.Client(f"127.0.0.1:{server.port}", bad, timeout=10)
            with pytest.raises(service.RefusedBySyncer, match="Join: missing or wrong credential"):
                wrong.call("Join", fields, wire.named(x))
            wrong.close()
        assert syncer.members == {} and syncer.anchor is None
        right = service.Client(f"127.0.0.1:{server.port}", _credential(0), timeout=10)
        f, anchor = right.call("Join", fields, wire.named(x))
        assert f == {"generation": 1, "round": 0, "finished": False}
        assert list(anchor) == ["['w']"]
        f, anchor = right.call(
            "Push",
            {"learner": 0, "generation": 1, "round": 0, "weight": 1.0, "push": "p0"},
            {"['w']": np.ones(3, np.float32)},
        )
        assert f["round"] == 1
        np.testing.assert_allclose(anchor["['w']"], np.full(3, -0.7 * 1.9), rtol=1e-6)
        right.close()
    finally:
        server.stop()
        syncer.close()


def test_over_grpc_a_late_learner_waits_for_the_round_its_push_joined(tmp_path):
    """Quorum 1 of 2 with no grace to speak of: learner 0 closes round 0 alone; learner 1's push
    for round 0 is late and joins round 1. Its answer is not round 1's open anchor but the one
    after round 1 closes (learner 0 pushes for round 1), so both go on from round 2 together."""
    import threading

    syncer = _syncer(tmp_path, _algorithm(), learners=2, quorum=1, grace=0.01,
                     adaptive_grace=False)  # fmt: skip
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    x = {"w": np.zeros(3, np.float32)}
    clients = [service.Client(f"127.0.0.1:{server.port}", _credential(i), timeout=10)
               for i in range(2)]  # fmt: skip

    def push(i, rnd):
        return clients[i].call(
            "Push",
            {"learner": i, "generation": 1, "round": rnd, "weight": 1.0, "push": f"{i}-{rnd}"},
            _ones(1.0),
        )[0]

    try:
        for i in (0, 1):
            clients[i].call("Join", {"learner": i, "describe": wire.describe(x),
                                     "keys": {"outer.sync_every": 3}}, wire.named(x))  # fmt: skip
        assert push(0, 0)["round"] == 1
        answers = {}
        late = threading.Thread(target=lambda: answers.update(late=push(1, 0)))
        late.start()
        late.join(0.5)
        assert late.is_alive() and syncer.round == 1  # waiting for round 1 to close
        assert push(0, 1)["round"] == 2
        late.join(10)
        assert answers["late"] == {"round": 2, "late": 1, "finished": False, "again": False}
    finally:
        for c in clients:
            c.close()
        server.stop()
        syncer.close()


# ---- learners that are runs ----------------------------------------------------------------


def _tiny(**overrides):
    from diloco_jax.config import apply_overrides, load_preset

    base = {"train.total_steps": 10, "train.sample_chars": 0, "log.figures": False}
    pairs = [(k, str(v)) for k, v in {**base, **overrides}.items()]
    return apply_overrides(load_preset("configs/tiny.py"), pairs)


def _alone_and_as_learner(tmp_path, monkeypatch, keys: dict):
    """``(alone, as learner, syncer)``: ``train()`` of the tiny preset with ``keys`` on its own,
    and as the only learner of an in-process syncer over gRPC (stopped after)."""
    from diloco_jax.learners.command import make_syncer
    from diloco_jax.train import train

    want = train(_tiny(**keys), tmp_path / "one", show_progress=False)
    syncer = make_syncer(_tiny(**keys), tmp_path / "syncer")
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    monkeypatch.setenv("DILOCO_SERVE_TOKEN", TOKEN)
    try:
        got = train(_tiny(**keys, **{"syncer.address": f"127.0.0.1:{server.port}"}),
                    tmp_path / "learner", show_progress=False)  # fmt: skip
    finally:
        server.stop()
        syncer.close()
    return want, got, syncer


def _learner(i: int, port: int, workdir: pathlib.Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "diloco_jax.train", "--config", "tiny", "--workdir",
               str(workdir), "--config.parallel.replicas=1", "--config.syncer.learners=2",
               f"--config.syncer.learner={i}", f"--config.syncer.address=127.0.0.1:{port}",
               "--config.train.total_steps=10", "--config.train.sample_chars=0",
               "--config.log.figures=false", *extra]  # fmt: skip
    env = helpers.child_env(DILOCO_SERVE_TOKEN=TOKEN, TQDM_DISABLE="1")
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_a_learners_data_is_its_part_of_every_learners():
    """Learner i of L with R replicas trains replicas i*R .. i*R+R-1 of L*R: their indices
    (its batches' seeds) and their data shards, the same as a run of L*R replicas holds."""
    from diloco_jax.run.setup import build

    everyone = build(_tiny(**{"parallel.replicas": 4, "parallel.runtime": "sim"}))
    second = build(_tiny(**{"parallel.replicas": 2, "syncer.learners": 2, "syncer.learner": 1,
                            "syncer.address": "127.0.0.1:9"}))  # fmt: skip
    assert np.asarray(second.replicas_R).tolist() == [2, 3]
    np.testing.assert_array_equal(np.asarray(second.shards_RxS),
                                  np.asarray(everyone.shards_RxS)[2:4])  # fmt: skip


def test_a_learners_streamed_data_is_its_part_of_every_learners(tmp_path):
    """A corpus too large for ``data.max_memory_mib`` is streamed from disk: learner 1 of 2
    with 2 replicas reads, call by call, the windows replicas 2 and 3 of a 4-replica run
    read (their shards, and their draws seeded by the replicas' global indices)."""
    import lzma

    from diloco_jax.data.stream import StreamedShards
    from diloco_jax.run.setup import build
    from tests.test_stream import BUDGET_MIB, SHAKESPEARE

    corpus = tmp_path / "big.txt"
    with lzma.open(SHAKESPEARE) as f:
        corpus.write_bytes(f.read(300_000))
    streamed = {"data.corpus": str(corpus), "data.max_memory_mib": BUDGET_MIB}
    everyone = build(_tiny(**streamed, **{"parallel.replicas": 4, "parallel.runtime": "sim"}),
                     abstract=True)  # fmt: skip
    second = build(_tiny(**streamed, **{"parallel.replicas": 2, "syncer.learners": 2,
                                        "syncer.learner": 1, "syncer.address": "127.0.0.1:9"}),
                   abstract=True)  # fmt: skip
    assert isinstance(second.stream, StreamedShards) and second.stream.first_replica == 2
    np.testing.assert_array_equal(second.stream.batches(10, range(2)),
                                  everyone.stream.batches(10, range(2, 4)))  # fmt: skip


def test_a_learners_grain_pipelines_are_its_replicas_of_every_learners():
    """A user's GrainTask as learner 1 of 2, with 2 replicas: its stream opens the pipelines
    of replicas 2 and 3 of 4 (the user's function is told so) and reads, call by call, what a
    run of 4 replicas reads for them."""
    from diloco_jax.fit import make_config
    from diloco_jax.run.setup import build
    from tests.test_grain_task import map_pipeline, task
    from tests.test_user_task import TINY

    opened = []

    def recording(**kw):
        opened.append((kw["replica"], kw["replicas"]))
        return map_pipeline(**kw)

    four = build(make_config(None, {**TINY, "parallel.replicas": 4}), task=task(map_pipeline))
    second = build(make_config(None, {**TINY, "parallel.replicas": 2, "syncer.learners": 2,
                                      "syncer.learner": 1, "syncer.address": "127.0.0.1:9"}),
                   task=task(recording))  # fmt: skip
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for call in range(2):
        first = call * four.stream.num_steps
        got, want = (jax.device_get(s.stream.on_devices(first, jax.tree.map(
            lambda _: one, s.stream.spec))) for s in (second, four))  # fmt: skip
        chex.assert_trees_all_equal(got, jax.tree.map(lambda x: x[:, 2:4], want))
    # replica 0 of 4 read once for the batch's shape; then the learner's own, 2 and 3 of 4
    assert set(opened) - {(0, 4)} == {(2, 4), (3, 4)}


# int8 with error feedback, on a mesh of two devices (a replica each)
INT8 = {"compress.codec": "int8", "compress.min_size": 64, "compress.error_feedback": True,
        "parallel.replicas": 2, "parallel.runtime": "mesh"}  # fmt: skip
DELAYED = {"outer.mode": "delayed", "train.total_steps": 15}  # three syncs
EAGER = {"outer.mode": "eager", "train.total_steps": 15, "parallel.replicas": 2}
FSDP = {"parallel.runtime": "mesh", "parallel.fsdp": True, "parallel.data_devices": 2}
SPARSE = {"compress.codec": "sparseloco", "compress.min_size": 1024, "parallel.replicas": 2,
          "parallel.runtime": "mesh"}  # fmt: skip


@pytest.mark.parametrize("variant", [
    # ~16 s; the default suite's stand-ins: every other variant (each trains through train()
    # as a learner against the run alone) and a user's ArrayTask as a learner, bitwise
    pytest.param({}, id="float32", marks=pytest.mark.slow),
    # ~33 s; the default suite's stand-ins: a push through every codec is the core's code and
    # the simulator's payload (test_a_push_travels_...), and the other variants through train()
    pytest.param(INT8, id="int8 on a mesh of 2", marks=pytest.mark.slow),
    pytest.param(DELAYED, id="overlapped"),
    # ~30 s; the default suite's stand-in: four learners through a syncer, eager (core level)
    pytest.param(EAGER, id="eager", marks=pytest.mark.slow),
    pytest.param(FSDP, id="fsdp over 2 devices"),
    # ~20 s; the default suite's stand-in: learners through a syncer with DCT momentum and
    # SparseLoCo equal the core's replicas (tests/test_sparse_learners.py)
    pytest.param(SPARSE, id="sparseloco on a mesh of 2", marks=pytest.mark.slow)])  # fmt: skip
def test_a_learner_in_this_process_trains_what_one_replica_trains(tmp_path, monkeypatch,
                                                                  variant):  # fmt: skip
    """``train()`` as the only learner of a syncer (served from this process) equals DiLoCo
    with one replica: the learner's steps, its pushes and restarts between calls, the syncer's
    outer step. The same final anchor (bitwise) and evaluation.

    With int8 and error feedback, on a mesh of two devices (two replicas under ``shard_map``):
    each replica encodes its pseudo-gradient as the core does, the push carries their mean's
    code again (two replicas: the same values), and the learner ends where the mesh runtime's
    two replicas do, to float32 rounding; the push's bytes are the simulator's
    parameter-server payload. Overlapped (``outer.mode=delayed``): the push goes on in the
    background and the learner restarts from the anchor of the push before, which is the
    simulator's delayed outer step, bit for bit. Eager (two replicas): the syncer answers with
    the round's mean, and the learner's replicas take their own outer steps on the mean of
    the push before with their fresh shares: the simulator's eager step, bit for bit. FSDP
    (one replica split over two devices): the learner's parts keep the state split, the
    anchor is gathered whole for the push, and the run equals the mesh runtime's with FSDP.
    SparseLoCo on a mesh of two devices: the push holds both replicas' messages (2-bit codes),
    each replica's accumulator stays with it, and the syncer decodes the push with the core's
    decoder: the mesh runtime's two replicas."""
    from diloco_jax.config import recipe
    from diloco_jax.simulated import comms

    one = {"parallel.replicas": 1, "parallel.runtime": "sim", **variant}
    want, got, syncer = _alone_and_as_learner(tmp_path, monkeypatch, one)
    # overlapped too: the learner's last push is answered before it ends
    overlapped = variant.get("outer.mode") in ("delayed", "eager")
    assert syncer.round == (3 if overlapped else 2)
    if variant is not INT8:
        chex.assert_trees_all_equal(got["state"].anchor, want["state"].anchor)
        chex.assert_trees_all_equal(got["state"].params, want["state"].params)
        assert got["final_eval_loss"] == want["final_eval_loss"]
    else:  # two programs round differently (a fused multiply-add, the push's block scales
        # divided again): float32 rounding, 3e-8 at most here, far below an int8 code step
        chex.assert_trees_all_close(got["state"].anchor, want["state"].anchor, rtol=0, atol=1e-6)
        assert got["final_eval_loss"] == pytest.approx(want["final_eval_loss"], abs=1e-5)
    # its metrics report the syncer's rounds (not the zeros of a sync it does not take);
    # overlapped, the round a sync reports is the one before (the first sync has none)
    rounds = helpers.events(tmp_path / "learner", "round")
    assert [(e["step"], e["base_round"], e["round"], e["late"]) for e in rounds] == (
        [(10, 0, 1, 0), (15, 1, 2, 0)] if overlapped else [(5, 0, 1, 0), (10, 1, 2, 0)]
    )
    # the bytes on the wire: the simulator's accounting for a syncer (a parameter server: the
    # push one way, the float32 anchor the other) plus the messages' framing (a JSON header
    # naming the leaves, checksums)
    anchor = want["state"].anchor
    if variant is EAGER:  # every replica has its own anchor, and one's size travels
        anchor = jax.tree.map(lambda x: x[0], anchor)
    cfg = _tiny(**variant)  # SparseLoCo: each replica's message, the replicas' count of them
    push = comms.push_payload(anchor, recipe.codec_of(cfg), cfg.parallel.replicas,
                              dct_config=recipe.dct_of(cfg))  # fmt: skip
    up = comms.bytes_per_replica(push, 2, "parameter_server")
    down = comms.payload_bytes(anchor)  # the float32 anchor, whatever the codec
    # int8: 1 byte a value and a scale per 256; SparseLoCo: 64 of every 4096 values, 2 bits each
    assert (up < down / 3.5) == (variant is INT8 or variant is SPARSE)
    framing = [(e["bytes_sent"] - up, e["bytes_received"] - down) for e in rounds]
    assert all(0 < f < 2048 for pair in framing for f in pair), framing  # 0.7-1 KB, 12 leaves
    assert not helpers.events(tmp_path / "learner", "sync")


STREAMING = {"streaming.fragments": 2, "streaming.mix": 0.5, "model.num_layers": 2,
             "outer.sync_every": 10, "train.total_steps": 20, "parallel.replicas": 1,
             "parallel.runtime": "sim"}  # fmt: skip


@pytest.mark.slow  # ~18 s each; the default suite's stand-in: streaming learners through a
# syncer against the core's streaming replicas (the learner's own sync parts, F = 2 and 4, tau)
@pytest.mark.parametrize("overlap", [0, 2])
def test_a_streaming_learner_in_this_process_trains_what_one_streaming_replica_trains(
        tmp_path, monkeypatch, overlap):  # fmt: skip
    """``train()`` as the only learner of a syncer with two streaming fragments (one sync every
    5 steps, fragment 1 then 0, mixed in at 0.5) equals the simulator's Streaming DiLoCo with
    one replica, bitwise: the same anchor, parameters and evaluation. Each round's push and
    answer carry one fragment: the two rounds of a period together carry the model once. With
    an overlap of 2 steps (a call a step) each answer lands 2 steps after its sync, while the
    learner trains on: the same anchor and final evaluation (the run's last sync lands at once,
    where the simulator's never lands: the parameters differ in that fragment alone)."""
    from diloco_jax.simulated import comms

    keys = {**STREAMING, **({"streaming.overlap": 2, "train.log_every": 1} if overlap else {})}
    want, got, syncer = _alone_and_as_learner(tmp_path, monkeypatch, keys)
    assert syncer.round == 4
    chex.assert_trees_all_equal(got["state"].anchor, want["state"].anchor)
    assert got["final_eval_loss"] == want["final_eval_loss"]
    rounds = helpers.events(tmp_path / "learner", "round")
    if overlap:  # a round is reported at the sync after its landing
        assert [(e["step"], e["base_round"]) for e in rounds] == [(10, 0), (15, 1), (20, 3)]
        return
    chex.assert_trees_all_equal(got["state"].params, want["state"].params)
    assert [(e["step"], e["base_round"]) for e in rounds] == [(5, 0), (10, 1), (15, 2), (20, 3)]
    model = comms.payload_bytes(want["state"].anchor)
    sent = [e["bytes_sent"] for e in rounds]
    assert sent[0] + sent[1] == pytest.approx(model, abs=4096)  # the framing aside
    # each fragment's push the same size every time it syncs, but for its header's few bytes
    # (the round's training loss is printed in as many digits as it takes)
    assert max(sent) < 0.75 * model and sent[:2] == pytest.approx(sent[2:], abs=32)


@pytest.mark.parametrize("mode", ["sync", "delayed", "eager"])
def test_a_learner_reads_its_anchor_to_the_host_once_a_round(tmp_path, monkeypatch, mode):
    """The anchor goes from the devices to the host (with FSDP gathered whole first) once at
    the join and once each sync, the copy kept for a join again: taking the answer needs only
    its shapes. A learner of the quadratic's one replica, through a syncer over gRPC, three
    rounds; overlapped, the first sync takes no answer (the replicas restart from the anchor
    that sync read), the others the answer of the push before."""
    import logging

    from diloco_jax.learners.learner import Learner

    algorithm, x0 = _algorithm(mode), jnp.zeros(3, jnp.float32)
    _, _, local = _learner_fns(algorithm)
    reads = []
    read = Learner._anchor

    def counted(self, state):
        reads.append(1)
        return read(self, state)

    monkeypatch.setattr(Learner, "_anchor", counted)
    syncer = _syncer(tmp_path, algorithm, learners=1, answer_mean=mode == "eager")
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    client = service.Client(f"127.0.0.1:{server.port}", _credential(0), timeout=30.0)
    learner = Learner(client, algorithm, learner=0, keys={"outer.sync_every": 3},
                      rows_per_round=3, heartbeat=10.0, log=logging.getLogger("test"),
                      overlap=mode == "delayed")  # fmt: skip
    try:
        state = learner.join(init_replicas(algorithm, x0, 1))
        each = [len(reads)]
        for rnd in range(3):
            for _ in range(3):
                state, _ = local(state, state.params - CENTERS_RxD[:1])
            state = learner.sync(state, last=rnd == 2)
            each.append(len(reads) - sum(each))
    finally:
        learner.close()
        server.stop()
        syncer.close()
    assert syncer.round == 3
    # the join, then each sync; it was [2, 3, 3, 3]: the join's and its restart's, the push's
    # and the answer's twice (eager [2, 2, 2, 2]: the answer's once)
    assert each == [1, 1, 1, 1]


def test_a_learners_push_travels_through_its_codec(tmp_path):
    """A learner with int8 pushes the codec's payload (the simulator's bytes for a push to a
    parameter server, plus the message's framing), a quarter of float32's, and the syncer
    decodes it into the round. The int8 in-process learner (slow) trains through it end to
    end."""
    import logging

    from diloco_jax.algorithm import compress
    from diloco_jax.learners.learner import Learner
    from diloco_jax.simulated import comms

    algorithm, x0_D = _algorithm("sync"), jnp.zeros(512, jnp.float32)
    target_D = jnp.asarray(np.random.default_rng(0).normal(size=512), jnp.float32)
    codec = compress.Codec("int8", block=64, min_size=64)
    _, _, local = _learner_fns(algorithm)
    syncer = _syncer(tmp_path, algorithm, learners=1, codec=codec)
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    client = service.Client(f"127.0.0.1:{server.port}", _credential(0), timeout=30.0)
    learner = Learner(client, algorithm, learner=0, keys={"outer.sync_every": 3},
                      rows_per_round=3, heartbeat=10.0, log=logging.getLogger("test"),
                      codec=codec)  # fmt: skip
    try:
        state = learner.join(init_replicas(algorithm, x0_D, 1))
        for _ in range(3):
            state, _ = local(state, state.params - target_D)
        state = learner.sync(state, last=True)
    finally:
        learner.close()
        server.stop()
        syncer.close()
    assert syncer.round == 1
    up = comms.push_payload(x0_D, codec)
    assert up < comms.payload_bytes(x0_D) / 3.5  # 1 byte a value and a scale per block
    assert 0 < learner.last["bytes_sent"] - up < 1024, learner.last  # the framing
    assert not np.array_equal(np.asarray(state.anchor), np.asarray(x0_D))  # the round landed


def test_a_user_task_as_a_learner_trains_what_it_trains_alone(tmp_path, monkeypatch):
    """A user's ``ArrayTask`` through ``fit``, as the only learner of a syncer (served from this
    process): the same final anchor and evaluation as ``fit`` with its one replica, bit for
    bit. The task, its loss and its data come from the user; the rounds are the syncer's."""
    from diloco_jax.config import ConfigError
    from diloco_jax.fit import fit, make_config
    from diloco_jax.learners.command import make_syncer
    from tests.test_user_task import TINY, linear_task

    overrides = {**TINY, "parallel.replicas": 1, "train.total_steps": 20,
                 "outer.sync_every": 5, "train.log_every": 5}  # fmt: skip
    want = fit(linear_task(), workdir=tmp_path / "alone", overrides=overrides,
               show_progress=False)  # fmt: skip
    syncer = make_syncer(make_config(None, overrides), tmp_path / "syncer")
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    monkeypatch.setenv("DILOCO_SERVE_TOKEN", TOKEN)
    try:
        got = fit(
            linear_task(),
            workdir=tmp_path / "learner",
            show_progress=False,
            overrides={**overrides, "syncer.address": f"127.0.0.1:{server.port}"},
        )
    finally:
        server.stop()
        syncer.close()
    assert syncer.round == 4
    chex.assert_trees_all_equal(got.params, want.params)
    assert got.eval_loss == want.eval_loss
    assert [e["round"] for e in got.history if e["event"] == "round"] == [1, 2, 3, 4]
    # the outer step is the syncer's: an outer transform given to fit would be ignored
    with pytest.raises(ConfigError, match="takes the syncer's outer step"):
        fit(linear_task(), workdir=tmp_path / "other", outer=optax.sgd(0.5),
            overrides={**overrides, "syncer.address": "127.0.0.1:9"})  # fmt: skip


@pytest.mark.slow  # ~40 s, two processes; the default suite's stand-in: "mesh of 2" above
def test_a_learner_of_two_processes_trains_what_two_replicas_train(tmp_path):
    """One learner of two processes (``diloco-launch -n 2``, a replica on each process's
    device, the mesh runtime): process 0 pushes, both restart from the answer it broadcasts.
    The syncer's last anchor and the learner's final evaluation equal the mesh runtime's two
    replicas in one process (two devices) to float32 rounding: each process compiles the step
    for its one device, which rounds the model's gradients otherwise (6e-8 at most here)."""
    from diloco_jax.learners.command import make_syncer
    from diloco_jax.train import train

    two = {"parallel.replicas": 2}
    want = train(_tiny(**two, **{"parallel.runtime": "mesh"}), tmp_path / "mesh",
                 show_progress=False)  # fmt: skip
    syncer = make_syncer(_tiny(**two), tmp_path / "syncer")
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    command = [
        sys.executable,
        "-m",
        "diloco_jax.launch",
        "-n",
        "2",
        "--devices_per_process",
        "1",
        "--",
        "--config",
        "tiny",
        "--workdir",
        str(tmp_path / "learner"),
        "--config.parallel.replicas=2",
        "--config.parallel.runtime=mesh",
        "--config.train.total_steps=10",
        "--config.train.sample_chars=0",
        "--config.log.figures=false",
        f"--config.syncer.address=127.0.0.1:{server.port}",
    ]
    env = helpers.child_env(DILOCO_SERVE_TOKEN=TOKEN, TQDM_DISABLE="1")
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
    finally:
        server.stop()
        syncer.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert syncer.round == 2
    mine = dict(zip(syncer.names, syncer.anchor, strict=True))
    for name, value in wire.named(want["state"].anchor).items():
        np.testing.assert_allclose(mine[name], value, rtol=0, atol=1e-6, err_msg=name)
    final = helpers.events(tmp_path / "learner", "done")[-1]["final_eval_loss"]
    assert final == pytest.approx(want["final_eval_loss"], abs=1e-5)
    tape = (tmp_path / "syncer" / "syncer.jsonl").read_text().splitlines()
    joined = [e for e in map(json.loads, tape) if e["event"] == "joined"]
    assert [e["learner"] for e in joined] == [0]  # one learner: process 0 joined, alone


def test_a_learner_ends_when_the_syncer_closes_the_runs_last_round(tmp_path, monkeypatch):
    """``syncer.rounds = 1``: the syncer closes round 0 and is finished; the learner ends at its
    next sync (step 5 of 10), evaluates the final anchor there and saves it; a learner that
    joins afterwards ends at once with the same anchor."""
    from diloco_jax.learners.command import make_syncer
    from diloco_jax.train import train

    cfg = _tiny(**{"parallel.replicas": 1, "syncer.rounds": 1})
    syncer = make_syncer(cfg, tmp_path / "syncer")
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    monkeypatch.setenv("DILOCO_SERVE_TOKEN", TOKEN)
    learner = _tiny(**{"parallel.replicas": 1, "syncer.address": f"127.0.0.1:{server.port}"})
    try:
        got = train(learner, tmp_path / "learner", show_progress=False)
        late = train(learner, tmp_path / "late", show_progress=False)
    finally:
        server.stop()
        syncer.close()
    assert syncer.round == 1 and syncer.finished
    assert got["steps"] == 5 and late["steps"] == 0
    assert helpers.events(tmp_path / "learner", "eval")[-1]["step"] == 5
    np.testing.assert_array_equal(wire.named(got["state"].anchor)[syncer.names[0]],
                                  syncer.anchor[0])  # fmt: skip
    assert late["final_eval_loss"] == got["final_eval_loss"]
    assert [e["event"] for e in map(json.loads, (tmp_path / "syncer" / "syncer.jsonl").open())
            ].count("finished") == 1  # fmt: skip


def test_a_syncer_stopped_and_restarted_mid_run_loses_nothing(tmp_path, monkeypatch):
    """The syncer is stopped after round 1 and a new one started on its directory and port
    while the learner trains on: the learner retries until it answers, joins again (the new
    syncer does not know it), pushes its round-1 work again, and the run ends with the same
    anchor, bit for bit, as with one syncer throughout."""
    import threading
    import time

    from diloco_jax.learners.command import make_syncer
    from diloco_jax.train import train

    one = {"parallel.replicas": 1, "parallel.runtime": "sim", "train.total_steps": 15}
    want = train(_tiny(**one), tmp_path / "one", show_progress=False)
    first = make_syncer(_tiny(**one), tmp_path / "syncer")
    server = service.Server(first, "127.0.0.1", 0, secret=TOKEN).start()
    port, servers = server.port, [server]

    def restart():
        with first.lock:
            while first.round < 1:
                first.lock.wait(0.05)
        server.stop(grace=0)
        first.close()
        time.sleep(0.5)  # the learner's next push meets no syncer
        second = make_syncer(_tiny(**one), tmp_path / "syncer")
        servers.append(service.Server(second, "127.0.0.1", port, secret=TOKEN).start())

    monkeypatch.setenv("DILOCO_SERVE_TOKEN", TOKEN)
    thread = threading.Thread(target=restart)
    thread.start()
    try:
        got = train(_tiny(**one, **{"syncer.address": f"127.0.0.1:{port}"}),
                    tmp_path / "learner", show_progress=False)  # fmt: skip
    finally:
        thread.join()
        servers[-1].stop()
        servers[-1].syncer.close()
    assert len(servers) == 2 and servers[-1].syncer.round == 3
    chex.assert_trees_all_equal(got["state"].anchor, want["state"].anchor)
    tape = [json.loads(x) for x in (tmp_path / "syncer" / "syncer.jsonl").open()]
    assert [e["event"] for e in tape].count("restored") == 1
    assert [e["closed"] for e in tape if e["event"] == "closed"] == [0, 1, 2]


@pytest.mark.slow  # ~45 s: two learner processes and a mesh run; stand-ins: the learner in this
# process above, the learners' data parts, four learners against the core's sync
def test_two_learners_of_one_replica_train_what_the_mesh_trains_with_two(tmp_path):
    """``python -m diloco_jax.train`` as 2 learners of one replica each (learner i: replica i's
    data shard) and a syncer: after 2 rounds the syncer's anchor and every learner's final
    evaluation equal the mesh runtime's with 2 replicas, to float32 reduction order (the
    pseudo-gradients' sum is taken in another order: at most 6e-8 apart, measured, on
    parameters of order 1; bound 1e-7 absolute plus 1e-6 relative)."""
    from diloco_jax.learners.command import make_syncer
    from diloco_jax.train import train

    mesh = _tiny(**{"parallel.runtime": "mesh", "parallel.replicas": 2})
    want = train(mesh, tmp_path / "mesh", show_progress=False)
    syncer = make_syncer(_tiny(**{"parallel.replicas": 1, "syncer.learners": 2}),
                         tmp_path / "syncer")  # fmt: skip
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    procs = [_learner(i, server.port, tmp_path / f"learner{i}") for i in range(2)]
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        server.stop()
        syncer.close()
    assert syncer.round == 2
    mesh_anchor = wire.named(want["state"].anchor)
    for name, got in zip(syncer.names, syncer.anchor, strict=True):
        np.testing.assert_allclose(got, mesh_anchor[name], rtol=1e-6, atol=1e-7, err_msg=name)
    for i in range(2):
        done = helpers.events(tmp_path / f"learner{i}", "done")[-1]
        assert done["final_eval_loss"] == pytest.approx(want["final_eval_loss"], rel=1e-6)
    closed = [json.loads(x) for x in (tmp_path / "syncer" / "syncer.jsonl").open()]
    assert [e["learners"] for e in closed if e["event"] == "closed"] == [[0, 1]] * 2


def test_a_learner_the_syncer_refuses_fails_in_one_line(tmp_path, monkeypatch, capsys):
    """A learner whose training keys differ from the syncer's: ``python -m diloco_jax.train``'s
    main says why in one line and exits 2, before any step; the syncer keeps no member."""
    from diloco_jax.learners.command import make_syncer
    from diloco_jax.train import main

    syncer = make_syncer(_tiny(**{"parallel.replicas": 1}), tmp_path / "syncer")
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    monkeypatch.setenv("DILOCO_SERVE_TOKEN", TOKEN)
    try:
        code = main(["--config", "tiny", "--workdir", str(tmp_path / "learner"),
                     "--config.parallel.replicas=1", "--config.outer.sync_every=10",
                     "--config.train.log_every=10", "--config.train.checkpoint_every=10",
                     f"--config.syncer.address=127.0.0.1:{server.port}"])  # fmt: skip
    finally:
        server.stop()
        syncer.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: Join: outer.sync_every is 10 on learner 0 "
                                            "but 5 on the syncer")  # fmt: skip
    assert not any(line.startswith("error") for line in err[:-1])
    assert syncer.members == {}
    # issue 61 finding 8: a learner's log lines say whose they are, as learners share terminals
    logged = [line for line in err[:-1] if line[:2].isdigit()]  # HH:MM:SS then the message
    assert logged and all(line.split(" ", 2)[1:2] == ["[learner"] for line in logged)
    assert "[learner 0] " in logged[0]


def test_a_learner_takes_an_accumulator_whole_and_refuses_it_what_needs_a_codec():
    """DCT momentum and SparseLoCo between learners: the pushes carry the replicas' messages
    (tests/test_sparse_learners.py). Compressed answers need a blockwise or top-k codec, and
    the core's DCT momentum does not stream: each refused in one line, naming the key."""
    from diloco_jax import config as config_lib
    from diloco_jax.config import recipe

    learner = {"syncer.address": "127.0.0.1:9", "parallel.replicas": 1}
    for codec in ("dct", "sparseloco"):
        cfg = _tiny(**learner, **{"compress.codec": codec})
        config_lib.validate(cfg)
        assert recipe.push_codec_of(cfg) == recipe.dct_of(cfg)
    for change, refused in [
        ({"compress.answers": True}, "compress.answers = True is invalid: needs compress.codec "
         "bf16, int8, fp8, int4 or topk"),
        (STREAMING, "compress.codec = 'sparseloco' is invalid: DCT momentum does not combine "
         "with streaming"),
    ]:  # fmt: skip
        with pytest.raises(config_lib.ConfigError, match=refused):
            config_lib.validate(_tiny(**{**learner, **change, "compress.codec": "sparseloco"}))


def test_a_streaming_learner_is_refused_what_it_does_not_support_in_one_line():
    """Streaming fragments between learners: the period (``outer.sync_every / F``) and the
    overlap multiples of ``train.log_every`` (a sync and a landing happen between calls),
    synchronous rounds (a quorum's late push would hold another round's fragment); each
    refused naming its key."""
    from diloco_jax import config as config_lib

    learner = {"syncer.address": "127.0.0.1:9", **STREAMING}
    config_lib.validate(_tiny(**learner))
    for change, refused in [
        ({"streaming.overlap": 2, "train.log_every": 5},
         "streaming.overlap = 2 is invalid: must be a multiple of train.log_every = 5"),
        ({"train.log_every": 10}, "outer.sync_every = 10 is invalid: divided by "
         r"streaming.fragments = 2 \(5\) must be a multiple of train.log_every = 10"),
        ({"syncer.quorum": 1}, "syncer.quorum = 1 is invalid: must be 0 with "
         "streaming.fragments = 2"),
    ]:  # fmt: skip
        with pytest.raises(config_lib.ConfigError, match=refused):
            config_lib.validate(_tiny(**learner, **change))


def test_the_status_page_and_metrics_show_the_learners_and_rounds(tmp_path):
    import urllib.error
    import urllib.request

    from diloco_jax.learners.status import StatusServer

    syncer = _syncer(tmp_path, _algorithm(), learners=2)
    page = StatusServer(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    x = {"w": np.zeros(3, np.float32)}
    try:
        syncer.join(0, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        syncer.join(1, wire.describe(x), {"outer.sync_every": 3}, wire.named(x))
        syncer.leave(1, 1)
        syncer.push(0, 1, 0, 1.0, {"['w']": np.ones(3, np.float32)})

        def get(path, credential=None):
            credential = identity.operator_credential(TOKEN) if credential is None else credential
            request = urllib.request.Request(
                f"http://127.0.0.1:{page.port}{path}",
                headers={"Authorization": f"Bearer {credential}"},
            )
            with urllib.request.urlopen(request) as r:
                return r.read().decode()

        for who in ("", TOKEN, _credential(0)):  # on loopback too: the operator's alone
            with pytest.raises(urllib.error.HTTPError, match="401"):
                get("/status", who)
        status = json.loads(get("/status"))
        assert status["round"] == 1 and status["members"]["1"]["status"] == "left"
        metrics = get("/metrics")
        assert "diloco_syncer_round 1.0" in metrics
        assert 'diloco_syncer_learners{status="present"} 1.0' in metrics
        assert 'diloco_syncer_learners{status="left"} 1.0' in metrics
        assert "<td>left</td>" in get("/")
    finally:
        page.stop()
        syncer.close()


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_learners_weight_is_its_replicas_mean_whatever_the_exchange(codec):
    """``contribution``'s weight is the replicas' mean weight, which a learner multiplies by its
    replicas and rows: a codec's exchange totals the weights as a sum, and a learner of two
    replicas pushed four replicas' examples before."""
    from diloco_jax.algorithm import compress

    chosen = None if codec == "none" else compress.Codec(codec, block=4, min_size=1)
    algorithm = diloco(optax.sgd(0.1), optax.sgd(0.7), sync_every=3, codec=chosen)
    state = init_replicas(algorithm, jnp.zeros(8, jnp.float32), 2)
    state = state._replace(params=state.params + jnp.arange(16.0).reshape(2, 8))
    axes = vmap_axes(algorithm)
    contribute = jax.vmap(algorithm.contribution, in_axes=(axes,), out_axes=(axes, 0, 0),
                          axis_name="replica")  # fmt: skip
    _, _, total_w_R = contribute(state)
    np.testing.assert_array_equal(np.asarray(total_w_R), [1.0, 1.0])
