"""Every float dtype of parameters: float64 trajectories agree with the hand-computed ones to
1e-12; bfloat16 and float16 train every variant and keep their dtypes (float32: every other
test)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import Streaming, dct, diloco, optim
from diloco_jax.algorithm.compress import Codec
from tests import test_diloco, test_variants

F64_TARGETS = test_variants.TARGETS_RxFxD.astype(np.float64)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def test_float64_quadratic_agrees_with_the_hand_computed_trajectory_to_1e12(x64):
    tx = diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=2)
    centers = test_diloco.CENTERS_RxD.astype(np.float64)
    traj, state = test_diloco.run_quadratic(tx, 6, centers, dtype=np.float64)
    expected = test_diloco.reference_quadratic(3, inner_lr=0.1, sync_every=2, outer_lr=0.7,
                                               momentum=0.9)  # fmt: skip
    assert traj.dtype == np.float64 and state.anchor.dtype == np.float64
    np.testing.assert_allclose(traj[1::2], np.repeat(expected[:, None], 2, axis=1), rtol=1e-12)


@pytest.mark.parametrize("overlap,mix", [(0, 0.0), (1, 0.3)])
def test_float64_streaming_agrees_to_1e12(x64, overlap, mix):
    streaming = Streaming(fragments=2, overlap=overlap, mix=mix)
    tx = diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4, streaming=streaming)
    traj, _ = test_variants.run_tree(tx, 12, F64_TARGETS)
    expected = test_variants.reference_streaming(
        12, sync_every=4, num_fragments=2, overlap=overlap, mix=mix, targets=F64_TARGETS
    )
    np.testing.assert_allclose(traj, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["delayed", "eager"])
def test_float64_delayed_and_eager_agree_to_1e12(x64, mode):
    tx = diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=3, outer_mode=mode)
    traj, _ = test_variants.run_tree(tx, 12, F64_TARGETS)
    expected = test_variants.reference_delayed(4, eager=mode == "eager", targets=F64_TARGETS)
    np.testing.assert_allclose(traj[2::3], expected, rtol=1e-12, atol=1e-14)


VARIANTS = {
    "plain": {},
    "int8_feedback": dict(codec=Codec("int8", block=2, min_size=0, error_feedback=True)),
    "topk_feedback": dict(codec=Codec("topk", topk_fraction=0.5, min_size=0,
                                      error_feedback=True)),
    "dct": dict(dct_config=dct.DctConfig(chunk=2, topk=1, min_size=0)),
    "streaming": dict(streaming=Streaming(fragments=2, overlap=1, mix=0.3)),
    "delayed": dict(outer_mode="delayed"),
    "eager": dict(outer_mode="eager"),
}  # fmt: skip
# bfloat16 keeps 8 significant bits, float16 11: a 12-step trajectory of values of order 1
TOLERANCE = {jnp.bfloat16: 0.1, jnp.float16: 0.02}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_low_precision_parameters_train_every_variant(x64, dtype, variant):
    tx = diloco(optax.sgd(0.1), optim.outer_nesterov(), sync_every=4, **VARIANTS[variant])
    traj, state = test_variants.run_tree(tx, 12, test_variants.TARGETS_RxFxD.astype(dtype))
    reference, _ = test_variants.run_tree(tx, 12, F64_TARGETS)
    assert traj.dtype == dtype
    for leaf in jax.tree.leaves((state.params, state.anchor, state.outer_state)):
        assert leaf.dtype == dtype
    np.testing.assert_allclose(traj.astype(np.float64), reference, atol=TOLERANCE[dtype])
    # training happened, in this dtype: the replicas' mean moved towards the mean target
    mean_target = F64_TARGETS.mean(0)
    gap = np.abs(traj[-1].astype(np.float64).mean(0) - mean_target).mean()
    assert gap < 0.5 * np.abs(mean_target).mean()
