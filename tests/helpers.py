"""Shared test builders: a tiny model on the shipped corpus, run by the simulator or a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diloco_jax import model as model_lib
from diloco_jax import optim, parallel
from diloco_jax.data import VOCAB_SIZE, load_corpus, replica_shards
from diloco_jax.step import StepControl, full_control, init_state, make_replica_step, state_axes

SEQ_LEN = 16
BATCH = 4
_CORPUS = {}


def corpus_train():
    if "train" not in _CORPUS:
        _CORPUS["train"] = load_corpus("shakespeare", val_fraction=0.05).train_N
    return _CORPUS["train"]


def tiny_model(seed=0):
    return model_lib.init_model(
        seed, vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN, d_model=16, num_layers=1, num_heads=2,
        mlp_ratio=2,
    )  # fmt: skip


def run(tx_for_axis, layout: parallel.Layout, num_steps: int, *, seed=0, replica_ids=None,
        batch=BATCH, shards=None, control=None, prepare=None):  # fmt: skip
    """Runs ``num_steps`` of the tiny model under ``layout``; returns the final TrainState and
    the metrics. ``shards``: how many shards to cut the corpus into (default: one per replica);
    ``control``: a dict of StepControl masks ``[num_steps, R]`` (default: plain DiLoCo);
    ``prepare``: a function applied to the initial replica-stacked state."""
    graphdef, params = tiny_model(seed)
    tx = tx_for_axis(layout.replica_axis_names)
    state = init_state(params, tx, layout.replicas)
    axes = state_axes(state)
    if prepare is not None:
        state = prepare(state)
    mesh = parallel.make_mesh(layout) if layout.runtime == "mesh" else None
    step = make_replica_step(
        graphdef, tx, seed=seed, batch_size=batch, seq_len=SEQ_LEN,
        data_axis=None if mesh is None else parallel.DATA, data_shards=layout.data_devices,
    )  # fmt: skip
    if mesh is None:
        fn = parallel.simulator_steps(step, axes, num_steps)
    else:
        fn = parallel.mesh_steps(step, axes, mesh, num_steps)
    ids = jnp.arange(layout.replicas) if replica_ids is None else jnp.asarray(replica_ids)
    shards_RxS = replica_shards(corpus_train(), shards or layout.replicas, SEQ_LEN)[ids]
    ctrl = full_control(num_steps, layout.replicas) if control is None else StepControl(**control)
    state, metrics = fn(
        parallel.place(state, axes, mesh),
        parallel.split_over_replicas(ids.astype(jnp.int32), mesh),
        parallel.split_over_replicas(shards_RxS, mesh),
        parallel.split_over_replicas(ctrl, mesh, axis=1),
    )
    return jax.device_get(state), jax.device_get(metrics)


def sim(replicas):
    return parallel.Layout("sim", replicas, 1, 1)


def adamw(total_steps=20):
    return optim.inner_adamw(learning_rate=1e-2, total_steps=total_steps, warmup_steps=2)
