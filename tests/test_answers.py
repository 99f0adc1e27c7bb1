"""Compressed answers (``compress.answers``, issue 55): the syncer answers with the anchor's
change through the run's codec and keeps the error feedback; every learner rebuilds the same
anchor, bit for bit, and restarts its replicas from it."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import compress, diloco, init_replicas, vmap_axes
from diloco_jax.learners import answers, identity, payload, service, wire
from diloco_jax.learners.syncer import Syncer

TOKEN = "answers-test-token"
KEYS = {"outer.sync_every": 3}
INT8 = compress.Codec("int8", block=64, min_size=64)
NAMES = ["['a']", "['b']"]


def _anchors(rounds: int, seed: int = 0, step: float = 0.05) -> list[list[np.ndarray]]:
    """A random walk of an anchor of two leaves: a big one (encoded) and a small one (float32)."""
    rng = np.random.default_rng(seed)
    a = [rng.normal(size=(40, 30)).astype(np.float32), rng.normal(size=7).astype(np.float32)]
    walk = [a]
    for _ in range(rounds):
        a = [x + (step * rng.normal(size=x.shape)).astype(np.float32) for x in a]
        walk.append(a)
    return walk


def _described(leaves):
    return [[n, list(x.shape), str(x.dtype)] for n, x in zip(NAMES, leaves, strict=True)]


def _scales(message: dict) -> np.ndarray:
    return np.asarray(message["codec/1"]).ravel()


def _blocks(leaves) -> np.ndarray:
    """The encoded leaf as the codec cuts it: blocks of 64 values (the small leaf is float32)."""
    flat = leaves[0].ravel()
    return np.pad(flat, (0, -flat.size % 64)).reshape(-1, 64)


def test_an_answer_decodes_to_the_anchor_within_the_codecs_bound_and_keeps_what_it_lost():
    """One round: the change ``A_1 - sent_0`` encoded in int8 blocks; the learners' anchor
    ``sent_1`` is ``sent_0`` plus its decode (the learner's own sum, bitwise), within half a
    code step (``scale / 2``) of the true anchor in every block, the small leaf exact but for
    float32 rounding. The next round's change carries what encoding lost: it encodes
    ``A_2 - sent_1``, not ``A_2 - A_1``."""
    a0, a1, a2 = _anchors(2)
    sent0 = answers.first(a0, 0)
    sent1 = answers.following(sent0, a1, NAMES, INT8)
    assert sent1.round == 1
    decoded = payload.decode(_described(a0), sent1.delta, INT8)
    for s, d, got in zip(sent0.leaves, decoded, sent1.leaves, strict=True):
        np.testing.assert_array_equal(got, s + d)  # float32: the learner's sum, bit for bit
    err_NxB = np.abs(_blocks(a1) - _blocks(sent1.leaves))
    bound_N = _scales(sent1.delta) / 2 * (1 + 1e-5) + 1e-6  # half a step, and float32 rounding
    assert np.all(err_NxB.max(axis=1) <= bound_N), (err_NxB.max(axis=1) / bound_N).max()
    assert err_NxB.max() > 0  # int8 lost something ...
    np.testing.assert_allclose(sent1.leaves[1], a1[1], rtol=0, atol=1e-6)  # float32 leaf
    sent2 = answers.following(sent1, a2, NAMES, INT8)  # ... which goes out with the next
    lost = [x - s for x, s in zip(a2, sent1.leaves, strict=True)]
    want = payload.encode(NAMES, lost, INT8)
    assert sent2.delta.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(sent2.delta[name], want[name])
    naive = payload.encode(NAMES, [x - y for x, y in zip(a2, a1, strict=True)], INT8)
    assert not np.array_equal(naive["codec/0"], want["codec/0"])


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_over_many_rounds_the_learners_anchor_does_not_drift(name):
    """40 rounds of a random walk: with the error kept on the syncer, the learners' anchor
    stays within one round's code step of the true one (int8, int4: half the last change's
    block scale; topk: the residual does not grow round over round), where answers that
    encoded each round's change alone would wander off as a sum of 40 errors."""
    codec = compress.Codec(name, block=64, min_size=64, topk_fraction=0.1)
    walk = _anchors(40, seed=1)
    sent, naive = answers.first(walk[0], 0), [x.copy() for x in walk[0]]
    errors, naive_errors = [], []
    for before, after in zip(walk, walk[1:], strict=False):
        sent = answers.following(sent, after, NAMES, codec)
        change = payload.encode(NAMES, [x - y for x, y in zip(after, before, strict=True)],
                                codec)  # fmt: skip
        naive = [answers.plus(x, d) for x, d in zip(
            naive, payload.decode(_described(naive), change, codec), strict=True)]  # fmt: skip
        errors.append(float(np.abs(after[0] - sent.leaves[0]).max()))
        naive_errors.append(float(np.abs(after[0] - naive[0]).max()))
        if name != "topk":
            bound = _scales(sent.delta).max() / 2 * (1 + 1e-5) + 1e-6
            assert errors[-1] <= bound, (len(errors), errors[-1], bound)
    assert max(errors[20:]) <= 1.5 * max(errors[:20])  # bounded: no drift
    assert naive_errors[-1] > 2 * errors[-1], (naive_errors[-1], errors[-1])


def _algorithm(outer_mode: str = "sync"):
    return diloco(optax.adamw(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=3,
                  outer_mode=outer_mode)  # fmt: skip


def _syncer(tmp_path, learners=2, **kw):
    kw = {"timeout": 30.0, "dead_after": 30.0, "codec": INT8, "compress_answers": True, **kw}
    return Syncer(_algorithm(), tmp_path / "syncer", keys=KEYS, learners=learners, **kw)


def _push(syncer, learner: int, rnd: int, rng, generation: int = 1) -> None:
    mean = payload.encode(["['w']"], [rng.normal(size=512).astype(np.float32)], INT8)
    syncer.push(learner, generation, rnd, 1.0, mean, push_id=f"{learner}-{generation}-{rnd}")


def test_a_copy_gets_the_same_bytes_a_joiner_the_learners_anchor_and_a_restart_keeps_it(
        tmp_path):  # fmt: skip
    """Through the syncer's rules: a push's answer is the change for a learner holding the round
    before (a copy of the push over gRPC gets the same bytes, marked ``again``), the whole
    reconstruction for one that holds no round. A learner that joins mid-run (learner 1, again)
    gets the reconstruction, not the true anchor, and rebuilds the next answer from it as the
    others do. A restarted syncer restores the reconstruction from its checkpoint; its first
    answer is whole (it kept no change), the next a change again."""
    x = {"w": np.zeros(512, np.float32)}
    rng = np.random.default_rng(0)
    syncer = _syncer(tmp_path, learners=2)
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    client = service.Client(f"127.0.0.1:{server.port}", identity.learner_credential(TOKEN, 0),
                            timeout=10)  # fmt: skip
    try:
        _, joined = client.call("Join", {"learner": 0, "describe": wire.describe(x),
                                         "keys": KEYS}, wire.named(x))  # fmt: skip
        held = answers.Held(INT8)
        held.joined(0, joined)
        syncer.join(1, wire.describe(x), KEYS, wire.named(x))
        _push(syncer, 1, 0, rng)
        fields = {"learner": 0, "generation": 1, "round": 0, "weight": 1.0, "push": "p",
                  "holds": 0}  # fmt: skip
        mean = payload.encode(["['w']"], [rng.normal(size=512).astype(np.float32)], INT8)
        first, delta = client.call("Push", fields, mean)  # closes round 0
        second, again = client.call("Push", fields, mean)
        assert (first["answer"], first["from"], second["again"]) == ("delta", 0, True)
        assert delta.keys() == again.keys() == {"codec/0", "codec/1"}
        for name in delta:
            np.testing.assert_array_equal(delta[name], again[name])
        assert payload.push_bytes(delta) < payload.push_bytes(wire.named(x)) / 3.5
        rebuilt = held.took(first, delta)["['w']"]
        np.testing.assert_array_equal(rebuilt, syncer.sent.leaves[0])
        assert not np.array_equal(rebuilt, np.asarray(syncer.anchor[0]))  # int8 lost a little
        rnd, whole, _, how = syncer.reply(0, 1.0, holds=None)  # holds no round: whole
        assert (rnd, how["answer"]) == (1, "whole")
        np.testing.assert_array_equal(whole["['w']"], syncer.sent.leaves[0])
        generation, rnd, anchor = syncer.join(1, wire.describe(x), KEYS, wire.named(x))
        assert (generation, rnd) == (2, 1)  # joined again, mid-run: the learners' anchor
        np.testing.assert_array_equal(anchor["['w']"], syncer.sent.leaves[0])
        joiner = answers.Held(INT8)
        joiner.joined(1, anchor)
        _push(syncer, 0, 1, rng)
        _push(syncer, 1, 1, rng, generation=2)
        for h in (held, joiner):  # both rebuild round 2's reconstruction from their own
            rnd, arrays, _, how = syncer.reply(1, 1.0, holds=h.round)
            got = h.took({**how, "round": rnd}, arrays)
            assert how["answer"] == "delta"
            np.testing.assert_array_equal(got["['w']"], syncer.sent.leaves[0])
        kept = syncer.sent
    finally:
        client.close()
        server.stop()
        syncer.close()
    restarted = _syncer(tmp_path, learners=2)  # the reconstruction restored
    try:
        assert restarted.round == 2 and restarted.sent.round == 2
        assert restarted.sent.sha == kept.sha
        rnd, arrays, _, how = restarted.reply(1, 1.0, holds=2)
        assert (rnd, how["answer"]) == (2, "whole")
        assert held.took({**how, "round": rnd}, arrays)["['w']"].tobytes() == (
            kept.leaves[0].tobytes())  # fmt: skip
        _push(restarted, 0, 2, rng)
        _push(restarted, 1, 2, rng, generation=2)
        rnd, arrays, _, how = restarted.reply(2, 1.0, holds=2)
        assert (rnd, how["answer"]) == (3, "delta")
        held.took({**how, "round": rnd}, arrays)
    finally:
        restarted.close()


def _local(algorithm):
    axes = vmap_axes(algorithm)
    return jax.jit(jax.vmap(lambda s, g: algorithm.update(s, g, sync=False), in_axes=(axes, 0),
                            out_axes=(axes, 0), axis_name="replica"))  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "delayed"])
def test_a_learner_restarts_from_the_rebuilt_anchor_and_receives_a_quarter(tmp_path, monkeypatch,
                                                                           mode):  # fmt: skip
    """A learner (one replica of a quadratic) with int8 pushes and compressed answers, through
    a syncer over gRPC, four rounds: after each sync its replicas' anchor and parameters are the
    syncer's reconstruction of the round it landed (``sent``, bitwise), not the true anchor;
    each answer after the join is the change, about a quarter of float32's bytes (plus the
    message's framing). Overlapped (``outer.mode=delayed``), the answer landed is the push
    before's, rebuilt in the sending thread from the anchor it held then."""
    from diloco_jax.learners.learner import Learner

    made = {}
    following = answers.following

    def kept(*args):  # every reconstruction the syncer makes, by round
        sent = following(*args)
        made[sent.round] = sent
        return sent

    monkeypatch.setattr(answers, "following", kept)
    algorithm, x0_D = _algorithm(mode), jnp.zeros(2048, jnp.float32)
    target_D = jnp.asarray(np.random.default_rng(0).normal(size=2048), jnp.float32)
    local = _local(algorithm)
    syncer = _syncer(tmp_path, learners=1)
    server = service.Server(syncer, "127.0.0.1", 0, secret=TOKEN).start()
    client = service.Client(f"127.0.0.1:{server.port}", identity.learner_credential(TOKEN, 0),
                            timeout=30.0)  # fmt: skip
    learner = Learner(client, algorithm, learner=0, keys=KEYS, rows_per_round=3, heartbeat=10.0,
                      log=logging.getLogger("test"), codec=INT8, overlap=mode == "delayed",
                      compress_answers=True)  # fmt: skip
    landed = []
    try:
        state = learner.join(init_replicas(algorithm, x0_D, 1))
        for _ in range(4):
            for _ in range(3):
                state, _ = local(state, state.params - target_D)
            state = learner.sync(state)
            if not learner.last:  # overlapped: the first sync lands no answer
                continue
            rnd = learner.last["round"]
            landed.append(rnd)
            np.testing.assert_array_equal(np.asarray(state.anchor), made[rnd].leaves[0])
            np.testing.assert_array_equal(np.asarray(state.params[0]), made[rnd].leaves[0])
            delta = payload.push_bytes(made[rnd].delta)
            assert delta < payload.push_bytes(wire.named(x0_D)) / 3.5
            assert 0 < learner.last["bytes_received"] - delta < 1024, learner.last
        learner.drain()
    finally:
        learner.close()
        server.stop()
        syncer.close()
    assert landed == ([1, 2, 3, 4] if mode == "sync" else [1, 2, 3])
    true_D = np.asarray(syncer.anchor[0])
    assert not np.array_equal(true_D, made[4].leaves[0])  # the syncer goes on from its own
    assert np.abs(true_D - made[4].leaves[0]).max() < 1e-2


@pytest.mark.parametrize("overrides, message", [
    ({"compress.codec": "int8"}, "it needs syncer.address"),
    ({"syncer.address": "127.0.0.1:5"}, "needs compress.codec bf16, int8"),
    ({"syncer.address": "127.0.0.1:5", "compress.codec": "int8", "outer.mode": "eager"},
     "does not combine with outer.mode=eager"),
])  # fmt: skip
def test_compressed_answers_are_refused_where_they_cannot_be(overrides, message):
    from diloco_jax import config as config_lib
    from diloco_jax.base.errors import ConfigError

    pairs = [(k, str(v)) for k, v in {"compress.answers": True, **overrides}.items()]
    cfg = config_lib.apply_overrides(config_lib.load_preset("tiny"), pairs)
    with pytest.raises(ConfigError, match=f"config key compress.answers = True is invalid: "
                       f"[^\n]*{message}"):  # fmt: skip
        config_lib.validate(cfg)
    with pytest.raises(ValueError, match="eager rounds answer with means"):
        answers.check(INT8, answer_mean=True)
