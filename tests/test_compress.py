"""Pseudo-gradient codecs: round-trip error bounds, exact byte counts, the compressed sum's
routing, error feedback, simulator == mesh, and the mesh's collectives carrying encoded bytes."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax import comms, compress, optim, parallel
from diloco_jax.algorithm import diloco, init_replicas, vmap_axes
from diloco_jax.compress import Codec
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


@pytest.mark.parametrize("name", ["bf16", "int8", "fp8", "int4", "topk"])
def test_compressed_sum_mesh_equals_simulator(name):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    x_RxP = jax.random.normal(jax.random.key(4), (4, 1000))
    codec = Codec(name, block=BLOCK, topk_fraction=0.05)
    sim = jax.vmap(lambda v: compress.compressed_sum(v, "r", codec)[0], axis_name="r")(x_RxP)
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("r",))
    on_mesh = jax.jit(jax.shard_map(lambda v: compress.compressed_sum(v[0], "r", codec)[0][None],
                                    mesh=mesh, in_specs=P("r"), out_specs=P("r"),
                                    check_vma=False))(x_RxP)  # fmt: skip
    # the same codes; only the float32 sum of decoded chunks may round differently
    np.testing.assert_allclose(on_mesh, sim, atol=2e-6)


@pytest.mark.slow  # 25 s; test_variants' sim == mesh with streaming + int8 trains on a mesh too
def test_int8_training_mesh_equals_simulator_to_one_code_step():
    codec = Codec("int8", block=BLOCK, min_size=64, error_feedback=True)
    sim_state, _ = helpers.run(codec_tx(codec), helpers.sim(4), 8)
    mesh_state, _ = helpers.run(codec_tx(codec), parallel.Layout("mesh", 4, 4, 1), 8)
    # vmap and shard_map compute gradients ~1e-7 apart; int8 rounding turns that into at most a
    # code step here and there (pseudo-gradients ~3e-2, block scale / 127 ~ 2e-4; observed 2.1e-4)
    chex.assert_trees_all_close(mesh_state.anchor, sim_state.anchor, atol=1e-3)
    plain, _ = helpers.run(codec_tx(None), helpers.sim(4), 8)
    leaves = zip(jax.tree.leaves(sim_state.anchor),
                 jax.tree.leaves(plain.anchor), strict=True)  # fmt: skip
    # the codec path was taken (it moves the anchor by ~3e-4 over these two syncs; the tight
    # check of the communication itself is test_compressed_sum_mesh_equals_simulator)
    assert max(float(np.abs(a - b).max()) for a, b in leaves) > 1e-5


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
    to_all = _collectives(hlo, "all-to-all")
    gathered = _collectives(hlo, "all-gather")
    # each device's message: `padded` int8 values, 4 pieces of padded / 4 (one per device)
    assert sum(n for t, n in to_all if t == "s8") == padded
    assert sum(n for t, n in to_all if t == "f32") == padded // BLOCK  # the scales
    assert sum(n for t, n in gathered if t == "s8") == padded  # every device's summed chunk
    # no float32 all-reduce of a compressed leaf's size is left
    reduced = _collectives(hlo, "all-reduce")
    assert reduced and max(n for t, n in reduced if t == "f32") < 1024
