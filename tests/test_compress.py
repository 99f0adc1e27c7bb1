"""Pseudo-gradient codecs: round-trip error bounds, exact byte counts, the compressed sum's
routing, error feedback, every exchange the same on every layout (virtual replicas included),
decoders that add replicas in order without duplicate scatter indices, and the mesh's
collectives carrying encoded bytes."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from diloco_jax.algorithm import compress, dct, diloco, exchange, init_replicas, optim, vmap_axes
from diloco_jax.algorithm.compress import Codec
from diloco_jax.base.axes import LOCAL_REPLICA, REPLICA
from diloco_jax.runtime import parallel
from diloco_jax.simulated import comms
from diloco_jax.tasks import Task
from tests import helpers

BLOCK = 64


def blocks(seed=0, count=32):
    """Random blocks whose magnitudes span 6 orders (each block its own scale), never all 0."""
    key1, key2 = jax.random.split(jax.random.key(seed))
    scale_Nx1 = 10.0 ** jax.random.uniform(key1, (count, 1), minval=-4, maxval=2)
    return jax.random.normal(key2, (count, BLOCK)) * scale_Nx1


def test_roundtrip_error_bounds():
    x = blocks()
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    err = {
        name: jnp.abs(compress.roundtrip(x, name) - x) for name in ("bf16", "int8", "fp8", "int4")
    }
    tiny = 1e-6 * amax  # float32 arithmetic in scale and division
    assert bool(jnp.all(err["bf16"] <= 2.0**-8 * jnp.abs(x)))
    assert bool(jnp.all(err["int8"] <= amax / 254 + tiny))
    assert bool(jnp.all(err["int4"] <= amax / 14 + tiny))
    # e4m3: 3 mantissa bits (relative 2**-4) above 2**-6 of the scale, absolute 2**-10 below
    assert bool(jnp.all(err["fp8"] <= jnp.maximum(2.0**-4 * jnp.abs(x), 2.0**-10 * amax / 448)))
    # and they are not trivially exact: every lossy codec loses something on random data
    assert all(float(e.max()) > 0 for e in err.values())
    zeros = jnp.zeros((2, BLOCK))
    for name in ("int8", "fp8", "int4"):
        np.testing.assert_array_equal(compress.roundtrip(zeros, name), zeros)


def test_int4_packs_two_values_per_byte():
    q, scale = compress.encode(blocks(count=3), "int4")
    assert q.dtype == jnp.uint8 and q.shape == (3, BLOCK // 2) and scale.shape == (3, 1)


def test_encoded_bytes_by_hand():
    n = 1024  # four blocks of 256
    assert compress.encoded_bytes(n, Codec("none")) == 4096
    assert compress.encoded_bytes(n, Codec("bf16")) == 2048
    assert compress.encoded_bytes(n, Codec("int8")) == 1024 + 4 * 4
    assert compress.encoded_bytes(n, Codec("fp8")) == 1024 + 4 * 4
    assert compress.encoded_bytes(n, Codec("int4")) == 512 + 4 * 4
    assert compress.encoded_bytes(1000, Codec("topk", topk_fraction=0.01)) == 10 * 8


def test_sync_payload_by_hand():
    tree = {"big": jnp.zeros((50, 100)), "small": jnp.zeros(100)}
    int8 = Codec("int8", block=256, min_size=4096)
    # 5000 values padded to a multiple of 4 x 256 = 5120: 5120 int8 + 20 float32 scales;
    # the small leaf: 100 float32
    assert comms.sync_payload(tree, int8, 4) == 5120 + 20 * 4 + 400
    assert comms.sync_payload(tree, None, 4) == 5100 * 4
    topk = Codec("topk", topk_fraction=0.01, min_size=4096)
    sent = comms.bytes_per_replica(comms.sync_payload(tree, topk, 4), 4)
    assert sent == 3 * 50 * 8 + 2 * 3 / 4 * 400  # all-gather of 50 pairs, ring of the rest


@pytest.mark.parametrize("name", ["bf16", "int8", "fp8", "int4"])
def test_compressed_sum_routes_chunks_like_a_ring(name):
    members, size = 4, 3 * BLOCK * 4 + 5  # not a multiple of the chunking
    x_RxP = jax.random.normal(jax.random.key(1), (members, size))
    codec = Codec(name, block=BLOCK)
    total, lost = jax.vmap(lambda v: compress.compressed_sum(v, "r", codec), axis_name="r")(x_RxP)
    # by hand: each member's message decoded, summed in float32, encoded again, decoded
    padded = compress.padded_size(size, members, BLOCK)
    x_pad = np.pad(np.asarray(x_RxP), ((0, 0), (0, padded - size)))
    sent = [np.asarray(compress.roundtrip(jnp.asarray(r.reshape(-1, BLOCK)), name)) for r in x_pad]
    summed = np.sum(sent, axis=0)
    expected = np.asarray(compress.roundtrip(jnp.asarray(summed), name)).reshape(-1)[:size]
    for r in range(members):
        np.testing.assert_allclose(total[r], expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(lost[r], x_pad[r][:size] - sent[r].reshape(-1)[:size],
                                   atol=1e-7)  # fmt: skip


def test_topk_sends_the_largest_and_sums_them():
    x_RxP = jax.random.normal(jax.random.key(2), (3, 200))
    codec = Codec("topk", topk_fraction=0.1)
    total, lost = jax.vmap(lambda v: compress.compressed_sum(v, "r", codec), axis_name="r")(x_RxP)
    expected = np.zeros(200)
    for r in range(3):
        row = np.asarray(x_RxP[r])
        keep = np.argsort(-np.abs(row))[:20]
        expected[keep] += row[keep]
        np.testing.assert_array_equal(np.flatnonzero(np.asarray(lost[r]) == 0), np.sort(keep))
    np.testing.assert_allclose(total[0], expected, rtol=1e-6)


def codec_tx(codec):
    def tx(axis):
        return diloco(helpers.adamw(), optim.outer_nesterov(), sync_every=3, axis_name=axis,
                      codec=codec)  # fmt: skip

    return tx


@pytest.mark.slow  # ~17 s; top-k is checked by hand in the default suite
def test_topk_of_everything_equals_plain_diloco():
    plain, _ = helpers.run(codec_tx(None), helpers.sim(4), 7)
    full, _ = helpers.run(codec_tx(Codec("topk", topk_fraction=1.0, min_size=0)), helpers.sim(4), 7)
    chex.assert_trees_all_close(full.anchor, plain.anchor, atol=1e-6)


def test_error_feedback_keeps_exactly_what_encoding_lost():
    codec = Codec("int8", block=BLOCK, min_size=0, error_feedback=True)
    tx = diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=1, axis_name="r", codec=codec)
    params = {"w": jnp.arange(300, dtype=jnp.float32) / 300}
    grads_RxP = jax.random.normal(jax.random.key(3), (2, 300))
    state = init_replicas(tx, params, 2)
    axes = vmap_axes(tx)

    def step(g, s):
        return tx.update(s, {"w": g})

    run = jax.vmap(step, in_axes=(0, axes), out_axes=(axes, 0), axis_name="r")
    state, _ = run(grads_RxP, state)
    # the pseudo-gradient after one SGD step, computed as the transform does; the residual is
    # its encoding loss
    delta_RxP = np.asarray(params["w"] - (params["w"] + grads_RxP * -0.1))
    padded = compress.padded_size(300, 2, BLOCK)
    residual_RxP = state.exchange_state[0][0]  # fragment 0 (the only one), leaf "w"
    for r in range(2):
        row = np.pad(delta_RxP[r], (0, padded - 300)).reshape(-1, BLOCK)
        loss = (row - np.asarray(compress.roundtrip(jnp.asarray(row), "int8"))).reshape(-1)[:300]
        # atol: one ulp of the parameters (~6e-8 near 1): XLA may fuse the inner update into
        # params + u (an FMA) and round the pseudo-gradient differently from numpy; the
        # residuals themselves are ~1e-3
        np.testing.assert_allclose(residual_RxP[r], loss, atol=6e-8)
    assert float(jnp.abs(residual_RxP).max()) > 0
    # the next sync sends pseudo-gradient + residual: what it loses is measured against that sum
    state2, _ = run(grads_RxP, state)
    assert not np.allclose(state2.exchange_state[0][0], residual_RxP)


LAYOUTS = {
    "4 devices": parallel.Layout("mesh", 4, 4, 1),
    "2 devices x 2 virtual": parallel.Layout("mesh", 4, 2, 1),
    "1 device x 4 virtual, data on 2": parallel.Layout("mesh", 4, 1, 2),
}
# the layouts that differ in mechanism: virtual replicas beside real devices, and a data axis
# (one replica per device, the first, is what both do across devices: in the slow variants)
DISTINCT = ("2 devices x 2 virtual", "1 device x 4 virtual, data on 2")
EXCHANGES = {
    **{f"{name}{'_ef' if ef else ''}": dict(codec=Codec(name, block=BLOCK, topk_fraction=0.05,
                                                         min_size=64, error_feedback=ef))
       for name in ("bf16", "int8", "fp8", "int4", "topk") for ef in (False, True)},
    "dct": dict(dct_config=dct.DctConfig(chunk=16, topk=4, min_size=64)),
    "sparseloco": dict(dct_config=dct.DctConfig(chunk=16, topk=4, beta=0.95, min_size=64,
                                                dct=False, bits=2)),
}  # fmt: skip
SHAPES = [(40, 30), (50,), (7, 9), (3, 100)]  # encoded, float32, float32, encoded
# the exchanges each layout runs in the default suite, one of each mechanism: a block scale with
# error feedback (int8, and int4's packing two values to a byte), top-k's positions and their
# scatter, the DCT's chunks and SparseLoCo's; the slow set runs the others (bf16's and fp8's
# casts, and each codec with and without error feedback)
MECHANISMS = ("int8_ef", "int4_ef", "topk", "dct", "sparseloco")


def _syncs():
    """Three syncs of 4 replicas: ``(delta leaves [T, R, ...], w_TxR, finite_TxR)``, float32.
    Magnitudes differ per replica and leaf (1e-2 .. 1); sync 0 weighs the replicas 1, 1/2, 0
    (left out) and 2; in sync 1 replica 3 is not finite (NaN); in sync 2 all take part."""
    rng = np.random.default_rng(5)
    delta = []
    for shape in SHAPES:
        scale = 10.0 ** rng.uniform(-2, 0, (3, 4) + (1,) * len(shape))
        delta.append((rng.standard_normal((3, 4, *shape)) * scale).astype(np.float32))
    delta[0][1, 3, 0, 0] = np.nan
    w_TxR = np.array([[1.0, 0.5, 0.0, 2.0], [1.0, 1.0, 1.0, 0.0], [1.0] * 4], np.float32)
    finite_TxR = np.ones((3, 4), bool)
    finite_TxR[1, 3] = False
    return delta, w_TxR, finite_TxR


def _every_exchange(axis_name, names):
    """One replica's syncs through the exchanges ``names`` of :data:`EXCHANGES`: ``{name: (the
    mean of each sync, the final state, the total weight of each sync)}``."""

    def make(kw):
        if "dct_config" in kw:
            return exchange.dct_momentum(axis_name, kw["dct_config"])
        return exchange.encoded(axis_name, kw["codec"])

    def syncs(delta_T, w_T, finite_T):
        out = {}
        for name in names:
            ex = make(EXCHANGES[name])

            def sync(state, inputs, ex=ex):
                mean, state, total_w = ex.mean(*inputs, state)
                return state, (mean, total_w)

            init = ex.init([d[0] for d in delta_T])
            state, (means, total_w) = lax.scan(sync, init, (delta_T, w_T, finite_T))
            out[name] = (means, state, total_w)
        return out

    return syncs


@functools.cache  # the layout tests share their compiled programs
def _exchanges_fn(layout, names=tuple(EXCHANGES)):
    """The syncs of :func:`_every_exchange`, jitted, run by ``layout`` as the train step is
    (vmap; shard_map of vmap); arguments as :func:`_syncs` returns them."""
    if layout.runtime == "sim":
        return jax.jit(jax.vmap(_every_exchange(REPLICA, names), in_axes=1, axis_name=REPLICA))
    local = jax.vmap(_every_exchange(layout.replica_axis_names, names), in_axes=1,
                     axis_name=LOCAL_REPLICA)  # fmt: skip
    run = jax.shard_map(local, mesh=parallel.make_mesh(layout), in_specs=P(None, REPLICA),
                        out_specs=P(REPLICA), check_vma=False)  # fmt: skip
    return jax.jit(run)


def _dct_step_and_share(delta) -> tuple[float, float]:
    """How far a top-k near-tie in the DCT may move a value of :func:`_every_exchange`'s output,
    and on what share of them. The DCT's matmuls round per vmap batch size (~1e-7 of a leaf's
    scale), so at a near tie a chunk sends another coefficient c of about the same magnitude:
    that chunk's 16 values of the mean and of the kept momentum move by <= 2 sqrt(2/S) |c|
    <= 2 sqrt(2) max|momentum|, and the momentum (beta 0.9, 3 syncs) is <= 2.71 max|delta|.
    One such chunk moves 16 values of 3 syncs' means on 4 replicas and 16 of the state: ~1% of
    the output; we allow two."""
    largest = max(float(np.nanmax(np.abs(d))) for d in delta)
    return 2 * np.sqrt(2) * 2.71 * largest, 0.02


def _assert_layout_agrees(name, got, want, delta, msg=""):
    """Exchange ``name``'s output on a layout against the simulator's, given the same inputs.
    Every exchange but the DCT is bitwise equal by construction: each replica encodes its own
    pseudo-gradient elementwise (no reduction but its block's max, exact in any order) and every
    sum over replicas runs in replica order (compress.fold). The DCT's matmuls are not."""
    if name != "dct":
        chex.assert_trees_all_equal(got, want, custom_message=f"{msg}{name}")
        return
    step, share = _dct_step_and_share(delta)
    helpers.assert_close_but_for_code_steps(got, want, step=step, max_share=share,
                                            msg=f"{msg}{name}: ")  # fmt: skip


@pytest.mark.parametrize("names", [
    MECHANISMS,
    # ~10 s more (a program of 7 exchanges on each layout); stand-in: the mechanisms above
    pytest.param(tuple(n for n in EXCHANGES if n not in MECHANISMS), marks=pytest.mark.slow),
], ids=["mechanisms", "the others"])  # fmt: skip
def test_every_exchange_is_the_same_on_every_layout(names):
    """Given the same pseudo-gradients, every exchange computes the same means and per-replica
    state (residuals, DCT momentum, SparseLoCo's accumulator) on every layout: each replica,
    virtual or not, encodes, drops or restarts as a replica on its own device would, and sums
    run in replica order."""
    args = _syncs()
    sim = _exchanges_fn(helpers.sim(4), names)(*args)
    assert sorted(sim) == sorted(names)
    for layout_name in DISTINCT:
        mesh = _exchanges_fn(LAYOUTS[layout_name], names)(*args)
        for name in names:
            _assert_layout_agrees(name, mesh[name], sim[name], args[0], f"{layout_name}: ")
    delta, w_TxR, _ = args
    exact = [np.einsum("r,r...->...", w_TxR[0], d[0]) / 3.5 for d in delta]
    for name, (means, _, total_w) in sim.items():
        np.testing.assert_array_equal(total_w[0], [3.5, 3.0, 4.0])  # replica 0's, per sync
        lost = max(float(np.abs(m[0, 0] - e).max()) for m, e in zip(means, exact, strict=True))
        assert 1e-6 < lost < 1.0, (name, lost)  # lossy, not broken


def test_the_layout_comparison_fails_a_planted_bug():
    """The comparisons above keep their power: on 2 devices x 2 virtual replicas, replica 0
    encoding replica 1's pseudo-gradient (and 1 encoding 0's), or an error feedback that drops
    its residual, fails them, the DCT's share bound and int8's alike."""
    delta, w_TxR, finite_TxR = _syncs()
    names = ("int8_ef", "dct", "sparseloco")
    # the programs of the test above (compiled once): it runs these among its mechanisms
    sim = _exchanges_fn(helpers.sim(4), MECHANISMS)(delta, w_TxR, finite_TxR)
    mesh = _exchanges_fn(LAYOUTS["2 devices x 2 virtual"], MECHANISMS)
    swapped = [d[:, [1, 0, 2, 3]] for d in delta]
    got = mesh(swapped, w_TxR, finite_TxR)
    for name in names:
        with pytest.raises(AssertionError):
            _assert_layout_agrees(name, got[name], sim[name], delta)
    # int8 under the DCT's bound (a whole coefficient per value, 2% of the values) fails too
    step, share = _dct_step_and_share(delta)
    with pytest.raises(AssertionError, match="values off by more than rounding"):
        helpers.assert_close_but_for_code_steps(got["int8_ef"], sim["int8_ef"], step=step,
                                                max_share=share)  # fmt: skip
    # error feedback that keeps no residual: the same means at the first sync, then not
    no_ef = _exchanges_fn(LAYOUTS["2 devices x 2 virtual"], ("int8",))(delta, w_TxR, finite_TxR)
    lost_means, kept_means = no_ef["int8"][0], sim["int8_ef"][0]
    with pytest.raises(AssertionError, match="values off by more than rounding"):
        helpers.assert_close_but_for_code_steps(lost_means, kept_means, step=step,
                                                max_share=share)  # fmt: skip
    chex.assert_trees_all_equal([m[:, 0] for m in lost_means], [m[:, 0] for m in kept_means])


def test_decoders_never_scatter_an_index_twice():
    """Top-k and DCT decoding add one replica's message at a time, whose positions are distinct:
    every scatter in the lowered programs (simulator; 2 devices x 2 virtual replicas) is marked
    ``unique_indices``, so no order of additions is left to the hardware (GPU atomics)."""
    args = _syncs()
    for layout in (helpers.sim(4), LAYOUTS["2 devices x 2 virtual"]):
        text = _exchanges_fn(layout, ("topk_ef", "dct")).lower(*args).as_text()
        scatters = [line for line in text.splitlines() if '"stablehlo.scatter"' in line]
        assert len(scatters) >= 4, text  # top-k: residual and sum; DCT: extract and sum
        assert all("unique_indices = true" in line for line in scatters), scatters


def test_decoders_add_replicas_in_order_like_numpy():
    """Messages whose positions repeat across replicas decode to numpy's float32 sum taken
    replica by replica (top-k: bitwise; DCT: its coefficients bitwise, then the matmul)."""
    rng = np.random.default_rng(6)
    x_RxP = rng.standard_normal((4, 200)).astype(np.float32)
    x_RxP[:, :12] *= 100  # positions 0..11 are among every replica's top 20
    codec = Codec("topk", topk_fraction=0.1)
    total, _ = jax.vmap(lambda v: compress.compressed_sum(v, "r", codec), axis_name="r")(x_RxP)
    expected = np.zeros(200, np.float32)
    for row in x_RxP:
        keep = np.argsort(-np.abs(row))[:20]
        expected[keep] += row[keep]
    for r in range(4):
        np.testing.assert_array_equal(total[r], expected)
    chunk, vals_RxNxK = 8, rng.standard_normal((4, 5, 3)).astype(np.float32)
    idx_RxNxK = np.stack([rng.permutation(chunk)[:3] for _ in range(20)]).reshape(4, 5, 3)
    idx_RxNxK[:, 0] = [1, 2, 3]  # chunk 0: the same positions from every replica
    c_NxS = np.zeros((5, chunk), np.float32)
    for vals_NxK, idx_NxK in zip(vals_RxNxK, idx_RxNxK, strict=True):
        c_NxS[np.arange(5)[:, None], idx_NxK] += vals_NxK
    config = dct.DctConfig(chunk=chunk, topk=3)
    no_scale_Rx5 = np.zeros((4, 5), np.float32)
    decoded = dct.decode_sum((vals_RxNxK, idx_RxNxK.astype(np.uint8), no_scale_Rx5), config)
    every_NxS = np.broadcast_to(np.arange(chunk, dtype=np.uint8), (5, chunk))
    whole = dct.DctConfig(chunk=chunk, topk=chunk)
    np.testing.assert_array_equal(decoded, dct.decode((c_NxS, every_NxS, no_scale_Rx5[0]), whole))
    reference = c_NxS.astype(np.float64) @ dct.matrix(chunk).astype(np.float64)
    np.testing.assert_allclose(decoded, reference.reshape(-1), rtol=1e-5, atol=1e-6)


def quadratic_task(size):
    """Replica r at step t minimises ``0.5 |params - target(r, t)|^2`` (all leaves flattened),
    the target drawn from ``(seed, r, t)`` in multiples of 1/64 and repeated in every
    batch row. Its gradient ``params - target`` is elementwise, so every layout computes it
    bitwise alike (the language model's gradients are not: XLA CPU rounds them differently for
    vmap batches of 1, 2 and 4 replicas, by ~1e-7, and a codec can turn that into a code step)."""

    def sample(shard, *, seed, replica, step, batch_size):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), replica), step)
        target_P = jax.random.randint(key, (size,), -256, 256).astype(jnp.float32) / 64
        return jnp.broadcast_to(target_P, (batch_size, size))  # the data axis splits rows

    def loss(params, target_BxP, dropout_key):
        flat_P = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(params)])
        return 0.5 * jnp.sum((flat_P - target_BxP[0]) ** 2)

    return Task(sample, loss, None, "example", 1)


def run_quadratic(tx_for_axis, layout, num_steps, weight_NxR, params=None):
    """:func:`helpers.run` on :func:`quadratic_task` with the per-step weights ``weight_NxR``;
    ``params`` default to leaves of :data:`SHAPES` (a few leaves compile faster than the tiny
    model's)."""
    if params is None:
        params = [jnp.full(shape, 0.5, jnp.float32) for shape in SHAPES]
    on = np.ones(weight_NxR.shape, bool)
    control = {"active": on, "weight": np.asarray(weight_NxR, np.float32), "take_anchor": on}
    task = quadratic_task(sum(x.size for x in jax.tree.leaves(params)))
    state, _ = helpers.run(tx_for_axis, layout, num_steps, control=control, task=task,
                           params=params, shards_RxS=np.zeros((layout.replicas, 1)))  # fmt: skip
    return state


@pytest.mark.parametrize(
    "name", [n if n == "int8_ef" else pytest.param(n, marks=pytest.mark.slow) for n in EXCHANGES]
)  # each ~10 s; test_every_exchange_is_the_same_on_every_layout covers every exchange by default
def test_training_is_the_same_on_every_layout(name):
    """DiLoCo with each exchange trains alike on 4 devices, 2 devices x 2 virtual replicas and
    1 device x 4 virtual replicas (batch split over 2 devices) as in the simulator: params,
    anchor and residuals after two syncs (one leaving a replica out)."""

    def tx(axis):  # inner SGD: AdamW's clipping norm is a reduction, rounded per batch size
        return diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=2, axis_name=axis,
                      **EXCHANGES[name])  # fmt: skip

    weight_NxR = np.ones((4, 4), np.float32)
    weight_NxR[1] = [1.0, 0.5, 0.0, 2.0]  # the first sync: replica 2 left out
    sim = run_quadratic(tx, helpers.sim(4), 4, weight_NxR)
    kept = [float(np.abs(x).max()) for x in jax.tree.leaves(sim.exchange_state)]
    assert max(kept, default=1.0) > 1e-3  # error feedback and DCT momentum kept something
    compared = lambda state: (state.params, state.anchor, state.exchange_state)  # noqa: E731
    # by default (int8_ef) the layouts that differ in mechanism; the slow exchanges all three
    for layout_name in DISTINCT if name == "int8_ef" else LAYOUTS:
        mesh = run_quadratic(tx, LAYOUTS[layout_name], 4, weight_NxR)
        if "dct_config" not in EXCHANGES[name] or not EXCHANGES[name]["dct_config"].dct:
            # bitwise by construction: the quadratic's gradients are elementwise, inner SGD
            # too, each replica encodes its own pseudo-gradient and sums run in replica order
            chex.assert_trees_all_equal(compared(mesh), compared(sim))
        else:
            assert_close_but_for_dct_ties(compared(mesh), compared(sim))


def assert_close_but_for_dct_ties(got, want):
    """A DCT run on a layout against the simulator, both on :func:`quadratic_task` with inner
    SGD: the DCT's matmuls round per vmap batch size, so at a near tie of a chunk's top-k
    another coefficient travels (see :func:`_dct_step_and_share`). A pseudo-gradient is the
    difference of two parameter vectors, <= 2 max|params|; through the momentum (2.71x) and a
    swapped coefficient (2 sqrt(2)x) that bounds a moved value; two chunks of 16 may move."""
    largest = max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
    helpers.assert_close_but_for_code_steps(got, want, step=2 * np.sqrt(2) * 2.71 * 2 * largest,
                                            max_share=0.02)  # fmt: skip


def _group_size(line: str) -> int:
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    return int(iota.group(2)) if iota else 0


def _collectives(hlo: str, op: str) -> list[tuple[str, int]]:
    """(element type, element count) of each operand of every ``op`` instruction that spans
    more than one device."""
    found = []
    for line in hlo.splitlines():
        if f" {op}(" not in line or _group_size(line) < 2:
            continue
        shapes = line.split("=", 1)[1].split(op + "(")[0]
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shapes):
            found.append((dtype, int(np.prod([int(d) for d in dims.split(",") if d] or [1]))))
    return found


def test_mesh_collectives_carry_int8_bytes():
    """Compile the mesh step with the int8 codec: the replica reduction moves int8 (plus one
    float32 scale per block) through all-to-all and all-gather, not float32."""
    codec = Codec("int8", block=BLOCK, min_size=1024)
    hlo, params = helpers.compiled_hlo(codec_tx(codec), parallel.Layout("mesh", 4, 4, 1), 3)
    large = sum(x.size for x in jax.tree.leaves(params) if x.size >= 1024)
    padded = compress.padded_size(large, 4, BLOCK)
    # the leaves under min_size travel in float32 through the same ring (summed in replica
    # order, so that no layout rounds them otherwise), padded to a multiple of 4 values
    small = compress.padded_size(sum(x.size for x in jax.tree.leaves(params)) - large, 4, 1)
    to_all = _collectives(hlo, "all-to-all")
    gathered = _collectives(hlo, "all-gather")
    # each device's message: `padded` int8 values, 4 pieces of padded / 4 (one per device)
    assert sum(n for t, n in to_all if t == "s8") == padded
    assert sum(n for t, n in to_all if t == "f32") == padded // BLOCK + small  # scales, small
    assert sum(n for t, n in gathered if t == "s8") == padded  # every device's summed chunk
    # no float32 all-reduce of a leaf is left (only scalars: the weights, stats)
    reduced = _collectives(hlo, "all-reduce")
    assert reduced and max(n for t, n in reduced if t == "f32") < 64
