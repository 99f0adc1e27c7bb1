"""SparseLoCo (issue 15): a per-replica error-feedback accumulator in place of outer momentum,
the top-k of each chunk of it sent as 2-bit codes and positions. Against a hand-computed numpy
exchange; keeping everything at full precision is plain DiLoCo with outer SGD; simulator ==
mesh; exact bytes; bad options refused with one line."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import dct, diloco, exchange, single
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.config import ConfigError, apply_overrides, load_preset, validate
from diloco_jax.runtime import parallel
from diloco_jax.simulated import comms
from tests import helpers
from tests.test_diloco import run_quadratic

LEVELS = np.array([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0])


def test_two_bit_codes_are_the_nearest_level_of_the_chunk_scale_packed_four_per_byte():
    vals_NxK = jnp.asarray([[0.9, -0.2, 0.4, -3.0, 1.1], [0.0, 0.0, 0.0, 0.0, 0.0]], jnp.float32)
    idx_NxK = jnp.asarray([[0, 1, 2, 3, 4]] * 2, jnp.uint8)
    message = dct.quantize(vals_NxK, idx_NxK, 2)
    packed, _, scale = message
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 2)  # 5 codes -> 2 bytes
    np.testing.assert_array_equal(scale, [3.0, 0.0])
    unit = np.asarray(vals_NxK[0]) / 3.0  # nearest of -1, -1/3, 1/3, 1
    want = LEVELS[np.abs(unit[:, None] - LEVELS[None]).argmin(1)] * 3.0
    np.testing.assert_allclose(dct.dequantize(message, 5)[0], want, rtol=1e-6)
    assert not np.isnan(np.asarray(dct.dequantize(message, 5))).any()  # a zero chunk stays finite
    # 4096 values in chunks of 4096, 64 kept: 64 uint16 positions, 16 code bytes, 1 scale
    assert dct.message_bytes(4096, dct.SPARSELOCO) == 128 + 16 + 4


def _numpy_sparseloco(delta_RxP, e_RxP, *, chunk, topk, beta):
    """Each replica: e' = beta e + delta; per chunk the topk largest |e'| quantized to the
    nearest of LEVELS x (the largest kept |value|); e'' = e' - sent; the mean of what was sent."""
    sent_RxP = np.zeros_like(delta_RxP)
    for r in range(len(delta_RxP)):
        acc = beta * e_RxP[r] + delta_RxP[r]
        for c in range(0, acc.size, chunk):
            part = acc[c : c + chunk]
            keep = np.argsort(-np.abs(part), kind="stable")[:topk]
            scale = np.abs(part[keep]).max()
            unit = part[keep] / scale
            sent_RxP[r, c + keep] = LEVELS[np.abs(unit[:, None] - LEVELS[None]).argmin(1)] * scale
        e_RxP[r] = acc - sent_RxP[r]
    return sent_RxP.mean(axis=0), e_RxP


def test_the_exchange_matches_a_hand_computed_sparseloco():
    config = DctConfig(chunk=8, topk=2, beta=0.5, min_size=0, dct=False, bits=2)
    ex = exchange.dct_momentum("r", config)
    delta_Rx40 = np.asarray(jax.random.normal(jax.random.key(1), (3, 40)))
    e_Rx40 = np.asarray(jax.random.normal(jax.random.key(2), (3, 40)))

    def one(delta, e):
        mean, e_new, _ = ex.mean([delta], jnp.float32(1.0), jnp.bool_(True), e)
        return mean[0], e_new

    mean, e_new = jax.vmap(one, axis_name="r")(delta_Rx40, e_Rx40)
    want_mean, want_e = _numpy_sparseloco(delta_Rx40, e_Rx40.copy(), chunk=8, topk=2, beta=0.5)
    for r in range(3):
        np.testing.assert_allclose(mean[r], want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e_new, want_e, rtol=1e-5, atol=1e-6)
    assert (np.count_nonzero(want_mean.reshape(5, 8), axis=1) <= 6).all()  # <= 3 x 2 per chunk
    # replica 2 left out (weight 0): it sends nothing, keeps its accumulator; the mean is the
    # others' (a 2-bit code 0 means -scale: its scale must be zeroed too, not only its codes)

    def weighted(delta, e, w):
        mean, e_new, _ = ex.mean([delta], w, jnp.bool_(True), e)
        return mean[0], e_new

    w_R = jnp.asarray([1.0, 1.0, 0.0])
    mean, e_new = jax.vmap(weighted, axis_name="r")(delta_Rx40, e_Rx40, w_R)
    two_mean, two_e = _numpy_sparseloco(delta_Rx40[:2], e_Rx40[:2].copy(), chunk=8, topk=2,
                                        beta=0.5)  # fmt: skip
    np.testing.assert_allclose(mean[0], two_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e_new[:2], two_e, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(e_new[2], e_Rx40[2])


def test_keeping_everything_at_full_precision_is_diloco_with_outer_sgd():
    """Every value sent as float32: the accumulator empties at each sync, so its decay never
    matters, and the mean is the plain mean; SparseLoCo's outer step is plain SGD."""
    whole = DctConfig(chunk=2, topk=2, beta=1.0, min_size=0, dct=False, bits=32)
    sparse, _ = run_quadratic(diloco(optax.sgd(0.1), optax.sgd(0.7), sync_every=2,
                                     dct_config=whole), num_steps=6)  # fmt: skip
    plain, _ = run_quadratic(diloco(optax.sgd(0.1), optax.sgd(0.7), sync_every=2), 6)
    np.testing.assert_allclose(sparse, plain, rtol=1e-6, atol=1e-7)


SMALL = DctConfig(chunk=64, topk=4, beta=0.95, min_size=256, dct=False, bits=2)


def _sparse_tx(axis):
    return diloco(helpers.adamw(), optax.sgd(1.0), sync_every=3, axis_name=axis,
                  dct_config=SMALL)  # fmt: skip


def test_sparseloco_on_the_mesh_equals_the_simulator():
    """One sync (step 3) and a local step after it, in the simulator and on 2 devices x 2
    virtual replicas with the batch on 2: the same state but for a few values that the 2-bit
    top-k sends differently."""
    steps, layout = 4, parallel.Layout("mesh", 4, 2, 2)
    sim_state, sim_loss = helpers.run(_sparse_tx, helpers.sim(4), steps)
    mesh_state, mesh_loss = helpers.run(_sparse_tx, layout, steps)
    # AdamW's clipping norm and the data axis's mean round per layout, so the pseudo-gradients
    # are a last bit apart; the chunk's top 4 and its 2-bit codes are the same but at a near
    # tie (another value sent) or a code boundary (a step of 2/3 of the chunk's scale). Either
    # moves a value of the sent message and of the accumulator by at most the chunk's scale,
    # the largest kept magnitude <= the largest pseudo-gradient x; the mean of 4 (outer
    # sgd(1.0)) moves the anchor by <= x / 4. Observed here: no value off.
    params = helpers.bigram_model()  # helpers.run's
    alone, _ = helpers.run(lambda ax: single(helpers.adamw()), helpers.sim(4), 3)
    x = max(float(np.abs(p[None] - p_R).max())
            for p, p_R in zip(jax.tree.leaves(params), jax.tree.leaves(alone.params), strict=True)
            )  # fmt: skip
    helpers.assert_close_but_for_code_steps(mesh_state, sim_state, step=x, max_share=0.001)
    # the losses up to the sync (the last one is the anchor's, bounded above)
    for metrics in (mesh_loss, sim_loss):
        metrics["loss"] = metrics["loss"][:3]
    chex.assert_trees_all_close(mesh_loss, sim_loss, atol=1e-5, rtol=1e-5)
    assert float(np.abs(sim_state.exchange_state[0]).max()) > 0  # the accumulators hold a rest


def test_sync_bytes_are_codes_positions_and_scales():
    params = {"big": np.zeros(1000, np.float32), "small": np.zeros(10, np.float32)}
    config = SMALL  # 1000 values: 16 chunks of 64, 4 kept: 4 uint8 positions + 1 + 4 bytes
    payload = comms.sync_payload(params, None, 4, config)
    assert payload == 10 * 4 + 4 * (16 * (4 + 1 + 4)) // 2  # all-gathered: R * message / 2
    assert comms.bytes_per_replica(payload, 4) == 1.5 * 40 + 3 * 16 * 9


@pytest.mark.parametrize("overrides,match", [
    ({"compress.sparse_bits": 3}, r"compress.sparse_bits = 3 is invalid: must be one of"),
    ({"compress.sparse_topk": 5000}, r"compress.sparse_topk = 5000 is invalid"),
    ({"compress.error_feedback": True}, r"sparseloco keeps what it does not send"),
])  # fmt: skip
def test_bad_sparseloco_options_are_one_line(overrides, match):
    pairs = [("compress.codec", "sparseloco"), *((k, str(v)) for k, v in overrides.items())]
    cfg = apply_overrides(load_preset("configs/default.py"), pairs)
    with pytest.raises(ConfigError, match=match):
        validate(cfg)
    validate(apply_overrides(load_preset("configs/default.py"), [("compress.codec", "sparseloco")]))
