"""A loss that draws from its ``rng`` trains the same on every layout (issue 39).

The key a replica's loss gets is a function of (seed, replica, step) alone
(:func:`diloco_jax.base.randomness.replica_key`), and a data split leaves the rows to XLA's
partitioner, so what the loss draws for a row is the same on one device, on a data split, with
the state split (FSDP) and in chunks with the state in host memory. The same standard as the
layout tests without dropout (tests/test_parallel.py): float32 reassociation only; two processes
are in tests/test_multiprocess.py (its run has ``model.dropout``).
"""

import functools

import chex
import jax
import numpy as np
import pytest

from diloco_jax.algorithm import init_replicas
from diloco_jax.runtime import chunked, parallel
from diloco_jax.runtime.step import full_control, make_replica_step
from tests import helpers
from tests.test_parallel import STEPS, diloco_tx

LAYOUTS = {
    "2 devices x 2 virtual": parallel.Layout("mesh", 4, 2, 1),
    "2x2, data split": parallel.Layout("mesh", 4, 2, 2),
    "FSDP 2x2": parallel.Layout("mesh", 4, 2, 2, fsdp=True),
}


@pytest.fixture(scope="module")
def simulated():
    return helpers.run(diloco_tx, helpers.sim(4), STEPS, dropout=True)


def _chunked_offloaded():
    """The simulator in chunks of one replica, the state in host memory between them."""
    algorithm = diloco_tx("replica")
    make = functools.partial(make_replica_step, task=helpers.bigram_task(dropout=True),
                             batch_size=helpers.BATCH, dropout=True)  # fmt: skip
    run = chunked.ChunkedSteps(make(chunked.LocalOnly(algorithm)), algorithm, STEPS, chunk=1,
                               offload=True)  # fmt: skip
    state = init_replicas(algorithm, helpers.bigram_model(0), 4)
    shards = helpers.replica_shards(helpers.corpus_train(), 4, helpers.SEQ_LEN)
    state, metrics = run(state, np.arange(4, dtype=np.int32), shards, full_control(STEPS, 4))
    return jax.device_get(state), jax.device_get(metrics)


def test_the_loss_draws_from_its_key():
    """The check below cannot pass by dropout doing nothing: with it the run differs."""
    with_dropout, _ = helpers.run(diloco_tx, helpers.sim(4), 2, dropout=True)
    without, _ = helpers.run(diloco_tx, helpers.sim(4), 2)
    diffs = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), with_dropout.params,
                         without.params)  # fmt: skip
    gap = max(jax.tree.leaves(diffs))
    assert gap > 1e-3, gap  # 100x the tolerance below


@pytest.mark.parametrize("name", [*LAYOUTS, "chunks of 1, offloaded"])
def test_a_loss_with_dropout_trains_the_same_on_every_layout(simulated, name):
    if name in LAYOUTS:
        state, metrics = helpers.run(diloco_tx, LAYOUTS[name], STEPS, dropout=True)
    else:
        state, metrics = _chunked_offloaded()
    sim_state, sim_metrics = simulated
    # the same masks: every step's loss to float32 rounding (2e-6 of ~6 seen; another mask moves
    # it by 1e-2). AdamW divides a rare token's near-zero embedding gradient by its own RMS, so
    # its rounding becomes up to 1.7e-5 in that row (every other leaf within 7e-7)
    chex.assert_trees_all_close(metrics["loss"], sim_metrics["loss"], atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(state, sim_state, atol=5e-5, rtol=1e-5)


@pytest.mark.slow  # ~12 s; stand-ins: the bigram's 2x2 above, test_multiprocess's model.dropout
def test_the_transformers_dropout_is_the_same_on_a_data_split():
    """``model.dropout`` of the built-in Transformer: the simulator against a 2x2 mesh."""
    sim_state, sim_metrics = helpers.run(diloco_tx, helpers.sim(4), 4, model="transformer",
                                         dropout=0.3)  # fmt: skip
    state, metrics = helpers.run(diloco_tx, LAYOUTS["2x2, data split"], 4, model="transformer",
                                 dropout=0.3)  # fmt: skip
    # the same masks: every step's loss to float32 rounding (2e-6 of ~6 seen; another mask moves
    # it by 1e-2). AdamW divides a rare token's near-zero embedding gradient by its own RMS, so
    # its rounding becomes up to 1.7e-5 in that row (every other leaf within 7e-7)
    chex.assert_trees_all_close(metrics["loss"], sim_metrics["loss"], atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(state, sim_state, atol=5e-5, rtol=1e-5)
