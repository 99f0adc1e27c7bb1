"""DCT momentum and SparseLoCo between learners (issue 55): each learner's replicas keep their
accumulators, its push carries their own messages (:mod:`diloco_jax.learners.payload`), and
the syncer decodes them with the core's decoder. Against the core's own sync and the
simulator's accounting; malformed pushes refused by name."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import dct as dct_lib
from diloco_jax.algorithm import diloco, init_replicas, vmap_axes
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.learners import payload, wire
from diloco_jax.learners.syncer import Refused, Syncer
from tests import helpers

# small enough to compile fast, with one leaf under min_size (float32) and one over (messages)
SPARSELOCO = DctConfig(chunk=16, topk=5, beta=0.95, min_size=64, dct=False, bits=2)
DCT = DctConfig(chunk=16, topk=3, beta=0.9, min_size=64)
X0 = {"w": jnp.zeros((8, 20), jnp.float32), "b": jnp.zeros(5, jnp.float32)}


def _algorithm(config: DctConfig):
    return diloco(optax.adamw(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=3,
                  dct_config=config)  # fmt: skip


def _targets(replicas: int):
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(rng.normal(size=(replicas, *x.shape)), jnp.float32)
            for k, x in X0.items()}  # fmt: skip


def _parts(algorithm):
    axes = vmap_axes(algorithm)
    messages = jax.jit(jax.vmap(algorithm.messages, in_axes=(axes,), out_axes=(axes, 0, 0),
                                axis_name="replica"))  # fmt: skip
    mean = jax.jit(jax.vmap(algorithm.contribution, in_axes=(axes,), out_axes=(axes, 0, 0),
                            axis_name="replica"))  # fmt: skip
    restart = jax.jit(jax.vmap(algorithm.restart, in_axes=(axes, None), out_axes=axes))
    local = jax.jit(jax.vmap(lambda s, g: algorithm.update(s, g, sync=False), in_axes=(axes, 0),
                             out_axes=(axes, 0), axis_name="replica"))  # fmt: skip
    return messages, mean, restart, local


def _trained(algorithm, replicas: int):
    """Two replicas' state after three inner steps, and their push (the replicas' messages)."""
    messages, mean, _, local = _parts(algorithm)
    state, targets = init_replicas(algorithm, X0, replicas), _targets(replicas)
    for _ in range(3):
        state, _ = local(state, jax.tree.map(jnp.subtract, state.params, targets))
    return state, messages, mean


@pytest.mark.parametrize("config", [SPARSELOCO, DCT], ids=["sparseloco", "dct"])
def test_a_sparse_push_is_the_replicas_messages_and_decodes_to_the_cores_mean(config):
    """A learner of two replicas pushes each one's message as the core's sync all-gathers it:
    its values cost ``dct.message_bytes`` a replica (the simulator's count of one message), a
    float32 weight each, and the small leaf in float32 (``comms.push_payload``). The syncer's
    decode of it is the mean the core's own sync takes, bitwise (the same decoder)."""
    from diloco_jax.simulated import comms

    algorithm = _algorithm(config)
    state, messages, mean = _trained(algorithm, 2)
    _, part, total_w = messages(state)
    _, want, _ = mean(state)
    names, described = wire.leaf_names(X0), wire.describe(X0)
    pushed = payload.encode(names, jax.tree.map(lambda x: np.asarray(x[0]), part), config)
    one = dct_lib.message_bytes(X0["w"].size, config)
    assert payload.push_bytes(pushed) == 5 * 4 + 2 * (one + 4)
    assert payload.push_bytes(pushed) == comms.push_payload(X0, None, 2, dct_config=config)
    assert comms.sync_payload(X0, None, 2, config) == 5 * 4 + one  # R messages / 2: the ring's P
    assert float(total_w[0]) == 1.0  # the mean weight, as contribution's
    got = payload.decode(described, pushed, config)
    chex.assert_trees_all_equal(got, [np.asarray(w[0]) for w in want])


def test_a_malformed_sparse_push_is_refused_by_name(tmp_path):
    """The header check refuses a wrong dtype or shape, naming the array, before any data is
    read (the syncer refuses the push); the decode refuses a position out of its chunk or sent
    twice in one, and a negative weight."""
    algorithm = _algorithm(SPARSELOCO)
    state, messages, _ = _trained(algorithm, 1)
    _, part, _ = messages(state)
    names, described = wire.leaf_names(X0), wire.describe(X0)
    good = payload.encode(names, jax.tree.map(lambda x: np.asarray(x[0]), part), SPARSELOCO)
    positions = good["dct/positions"]
    for change, refused in [
        ({"dct/positions": positions.astype(np.int32)}, r"lacks dct/positions \(uint8\)"),
        ({"dct/values": good["dct/values"][:, :-1]}, r"dct/values is \[1, 9, 2\], expected "
         r"\[1, 10, 2\]"),
        ({"dct/scales": good["dct/scales"][None]}, "dct/scales is"),
        ({"dct/weights": np.ones((1, 1), np.float32)}, "lacks dct/weights"),
        ({"dct/extra": positions}, "the push has dct/extra"),
    ]:  # fmt: skip
        bad = {**good, **change}
        header = [[n, list(a.shape), str(a.dtype)] for n, a in bad.items()]
        with pytest.raises(wire.WireError, match=refused):
            payload.check_leaves(described, header, SPARSELOCO)
    out = positions.copy()
    out[0, 3, 1] = SPARSELOCO.chunk  # fits a uint8, not a chunk
    twice = positions.copy()
    twice[0, 2, 1] = twice[0, 2, 0]
    for change, refused in [
        ({"dct/positions": out}, r"a position of dct/positions outside \[0, 16\)"),
        ({"dct/positions": twice}, "dct/positions sent twice in one chunk"),
        ({"dct/weights": -good["dct/weights"]}, "dct/weights must be finite and >= 0"),
    ]:  # fmt: skip
        with pytest.raises(wire.WireError, match=refused):
            payload.decode(described, {**good, **change}, SPARSELOCO)
    syncer = Syncer(algorithm, tmp_path / "syncer", keys={}, learners=1, timeout=30.0,
                    dead_after=30.0, codec=SPARSELOCO)  # fmt: skip
    try:
        syncer.join(0, described, {}, wire.named(X0))
        with pytest.raises(Refused, match="outside"):
            syncer.push(0, 1, 0, 1.0, {**good, "dct/positions": out})
        with pytest.raises(Refused, match=r"lacks dct/positions \(uint8\)"):
            syncer.push(0, 1, 0, 1.0, {**good, "dct/positions": positions.astype(np.int32)})
        assert syncer.round == 0 and not syncer.pending
    finally:
        syncer.close()


@pytest.mark.parametrize("config, learners, replicas", [
    (SPARSELOCO, 4, 1),  # bitwise: the same float32 sums (shares of 1/4 scale exactly)
    (DCT, 1, 2),  # bitwise: one learner's decode is the core's, of the same messages
    (DCT, 2, 1),  # float32 rounding: each push's inverse DCT, then the sum
], ids=["sparseloco 4x1", "dct 1x2", "dct 2x1"])  # fmt: skip
def test_learners_through_a_syncer_equal_the_cores_replicas(tmp_path, config, learners,
                                                            replicas):  # fmt: skip
    """``learners`` learners of ``replicas`` replicas each, four rounds through a syncer, equal
    the simulator's run of ``learners x replicas`` replicas: the anchor, every replica's
    parameters and accumulator. Each learner pushes its replicas' messages; the syncer decodes
    each push with the core's decoder (the coefficients summed in replica order, the inverse
    DCT, divided by the weights) and takes the weighted mean of the pushes.

    SparseLoCo (no transform) is a sum of the same float32 values in the same order: bitwise,
    where the merge's shares (1/L) scale exactly (L a power of two). DCT between learners
    sums each push's inverse DCT where the core takes the inverse of the coefficients' sum:
    equal in exact arithmetic, a few float32 roundings apart (1-2e-7 here). Its values are
    float32, not quantized, so a last-bit difference moves what a replica sends by as much,
    and changes which coefficient it sends only at a tie of two magnitudes. Bitwise as the
    suite compiles (at XLA's default level the learners' programs fuse differently from the
    simulator's step, as for every codec)."""
    algorithm = _algorithm(config)
    count = learners * replicas
    targets = _targets(count)
    _, want, _ = helpers.run_vmapped(algorithm, X0, targets, 12)
    messages, _, restart, local = _parts(algorithm)
    syncer = Syncer(algorithm, tmp_path / "syncer", keys={}, learners=learners, timeout=30.0,
                    dead_after=30.0, codec=config)  # fmt: skip
    states = [init_replicas(algorithm, X0, replicas) for _ in range(learners)]
    names, described = wire.leaf_names(X0), wire.describe(X0)
    try:
        for i in range(learners):
            syncer.join(i, described, {}, wire.named(X0))
        for rnd in range(4):
            for i in range(learners):
                mine = jax.tree.map(lambda t, i=i: t[i * replicas : (i + 1) * replicas], targets)
                for _ in range(3):
                    grads = jax.tree.map(jnp.subtract, states[i].params, mine)
                    states[i], _ = local(states[i], grads)
                states[i], part, total_w = messages(states[i])
                part = jax.tree.map(lambda x: np.asarray(x[0]), part)
                pushed = payload.encode(names, part, config)
                syncer.push(i, 1, rnd, float(total_w[0]) * replicas, pushed)
            _, answer = syncer.wait(rnd, 1.0)
            states = [restart(s, wire.unnamed(X0, answer)) for s in states]
    finally:
        syncer.close()
    got = jax.tree.map(lambda *xs: np.concatenate(xs), *[
        (s.params, s.exchange_state) for s in states])  # fmt: skip
    if (config, learners) == (DCT, 2):
        close = lambda a, b: chex.assert_trees_all_close(a, b, rtol=0, atol=1e-6)  # noqa: E731
    else:
        close = chex.assert_trees_all_equal
    close(states[0].anchor, want.anchor)
    close(got, (want.params, want.exchange_state))
    assert np.abs(np.asarray(want.exchange_state[0])).max() > 0.1  # an accumulator was kept
