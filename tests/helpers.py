"""Shared test builders: a tiny model on the shipped corpus, run by the simulator or a mesh."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import re
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax import algorithm as algorithm_lib
from diloco_jax import tasks
from diloco_jax.algorithm import init_replicas, optim
from diloco_jax.data import VOCAB_SIZE, load_corpus, replica_shards, sample_batch
from diloco_jax.run import loop as loop_module
from diloco_jax.runtime import parallel
from diloco_jax.runtime.step import StepControl, full_control, make_replica_step
from diloco_jax.tasks import model as model_lib

BAR = "step/s"  # in every tqdm bar with unit "step" (train's)
SEQ_LEN = 16
BATCH = 4
_CORPUS = {}


def corpus_train():
    if "train" not in _CORPUS:
        _CORPUS["train"] = load_corpus("shakespeare", val_fraction=0.05).train_N
    return _CORPUS["train"]


def child_env(**extra) -> dict:
    """The environment for a child process that picks its own devices (an example, the
    launcher): the suite's, less its 8 fake CPU devices, so the child compiles as the suite does
    (tests/conftest.py's XLA flags), plus ``extra``."""
    env = {**os.environ, **extra}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                              env.get("XLA_FLAGS", "")).strip()  # fmt: skip
    return env


def events(workdir: pathlib.Path, kind: str | None = None) -> list[dict]:
    """The events of ``workdir/metrics.jsonl``, those whose ``event`` is ``kind`` if given."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if kind is None or e["event"] == kind]


def died_after(workdir: pathlib.Path, step: int, dest: pathlib.Path) -> pathlib.Path:
    """``dest``: a copy of the finished run in ``workdir`` without its checkpoints after
    ``step``, as if the run had died after that step's checkpoint (a resume test's second run,
    without training the same run twice)."""
    import shutil

    shutil.copytree(workdir, dest)
    for saved in (dest / "checkpoints").iterdir():
        if saved.name.isdigit() and int(saved.name) > step:
            shutil.rmtree(saved)
    return dest


def tiny_model(seed=0, dropout=0.0):
    return model_lib.init_model(
        seed, vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN, d_model=16, num_layers=1, num_heads=2,
        mlp_ratio=2, dropout=dropout,
    )  # fmt: skip


def bigram_model(seed=0):
    """A bigram language model's parameters, named as the Transformer's embedding and head
    (``embed/embedding [V, D]``, ``head/kernel [D, V]``, ``head/bias [V]``): the algorithm's
    leaves without the Transformer's program, which compiles in about half the time."""
    embed_key, head_key = jax.random.split(jax.random.key(seed))
    return {
        "embed": {"embedding": jax.random.normal(embed_key, (VOCAB_SIZE, 16)) * 0.5},
        "head": {"kernel": jax.random.normal(head_key, (16, VOCAB_SIZE)) * 0.25,
                 "bias": jnp.zeros(VOCAB_SIZE)},
    }  # fmt: skip


def bigram_loss(params, tokens_BxL1, dropout_key=None):
    """Mean next-token nats of :func:`bigram_model`."""
    del dropout_key
    hidden_BxLxD = params["embed"]["embedding"][tokens_BxL1[:, :-1]]
    logits_BxLxV = hidden_BxLxD @ params["head"]["kernel"] + params["head"]["bias"]
    return model_lib.token_nll(logits_BxLxV, tokens_BxL1[:, 1:]).mean()


def bigram_dropout_loss(params, tokens_BxL1, rng):
    """:func:`bigram_loss` with dropout (rate 0.3) on the embeddings, drawn from ``rng``: a user
    loss whose randomness covers the whole batch."""
    hidden_BxLxD = params["embed"]["embedding"][tokens_BxL1[:, :-1]]
    keep_BxLxD = jax.random.bernoulli(rng, 0.7, hidden_BxLxD.shape)
    hidden_BxLxD = jnp.where(keep_BxLxD, hidden_BxLxD / 0.7, 0.0)
    logits_BxLxV = hidden_BxLxD @ params["head"]["kernel"] + params["head"]["bias"]
    return model_lib.token_nll(logits_BxLxV, tokens_BxL1[:, 1:]).mean()


def bigram_task(dropout: bool = False) -> tasks.Task:
    sample = functools.partial(sample_batch, seq_len=SEQ_LEN)
    return tasks.Task(sample, bigram_dropout_loss if dropout else bigram_loss, None, rng=dropout)


def build(algorithm_for_axis, layout: parallel.Layout, num_steps: int, *, seed=0,
          replica_ids=None, batch=BATCH, shards=None, control=None, prepare=None, task=None,
          params=None, shards_RxS=None, model="bigram", dropout=0.0):  # fmt: skip
    """The compiled-to-be call of ``num_steps`` steps of a tiny model under ``layout`` and its
    arguments: ``(fn, args, params)`` (see :func:`run` for the keywords; ``task``, ``params``
    and ``shards_RxS`` replace the tiny language model, its parameters and its shards).
    ``model``: ``"bigram"`` (:func:`bigram_model`: the layout and algorithm tests, for their
    compile time) or ``"transformer"`` (:func:`tiny_model`: where the leaves of a real model
    matter, Muon's matrices say). ``dropout``: the bigram's dropout (rate 0.3 whatever the
    value) or the Transformer's ``model.dropout``, each keyed by the step's ``rng``."""
    if model == "bigram":
        default_params, default_task = bigram_model(seed), bigram_task(bool(dropout))
    else:
        graphdef, default_params = tiny_model(seed, dropout)
        default_task = tasks.language_model(graphdef, seq_len=SEQ_LEN)
    params = default_params if params is None else params
    task = default_task if task is None else task
    algorithm = algorithm_for_axis(layout.replica_axis_names)
    state = init_replicas(algorithm, params, layout.replicas)
    if prepare is not None:
        state = prepare(state)
    mesh = parallel.make_mesh(layout) if layout.runtime == "mesh" else None
    step = make_replica_step(
        algorithm, task, batch_size=batch,
        data_axis=parallel.DATA if mesh is not None and layout.data_devices > 1 else None,
        dropout=bool(dropout),
    )  # fmt: skip
    if mesh is None:
        fn = parallel.simulator_steps(step, algorithm.kinds, num_steps)
    else:
        specs = parallel.state_specs(state, algorithm.kinds, layout)
        fn = parallel.mesh_steps(step, algorithm.kinds, mesh, num_steps, fsdp_specs=specs)
    ids = jnp.arange(layout.replicas) if replica_ids is None else jnp.asarray(replica_ids)
    if shards_RxS is None:
        shards_RxS = replica_shards(corpus_train(), shards or layout.replicas, SEQ_LEN)[ids]
    ctrl = full_control(num_steps, layout.replicas, seed)
    if control is not None:  # the outer learning rate's scale is 1 unless given
        ctrl = StepControl(**{**ctrl._asdict(), **control})
    args = (
        parallel.place(state, algorithm.kinds, mesh, fsdp_split=layout.fsdp),
        parallel.split_over_replicas(ids.astype(jnp.int32), mesh),
        parallel.split_over_replicas(shards_RxS, mesh),
        parallel.split_over_replicas(ctrl, mesh, axis=1),
    )
    return fn, args, params


def run(algorithm_for_axis, layout: parallel.Layout, num_steps: int, **kwargs):
    """Runs ``num_steps`` of the tiny model under ``layout``; returns the final state and the
    metrics. ``algorithm_for_axis(axis_name)`` builds the algorithm. Keywords: ``seed``,
    ``replica_ids``, ``batch``; ``shards``: how many shards to cut the corpus into (default: one
    per replica); ``control``: a dict of StepControl masks ``[num_steps, R]`` (default: plain
    DiLoCo); ``prepare``: a function applied to the initial replica-stacked state."""
    fn, args, _ = build(algorithm_for_axis, layout, num_steps, **kwargs)
    state, metrics = fn(*args)
    return jax.device_get(state), jax.device_get(metrics)


def compiled_hlo(algorithm_for_axis, layout: parallel.Layout, num_steps: int) -> tuple[str, dict]:
    """The compiled HLO text of ``num_steps`` steps under ``layout``, and the initial params."""
    fn, args, params = build(algorithm_for_axis, layout, num_steps)
    return fn.lower(*args).compile().as_text(), params


def sim(replicas):
    return parallel.Layout("sim", replicas, 1, 1)


def adamw(total_steps=20):
    return optim.inner_adamw(learning_rate=1e-2, total_steps=total_steps, warmup_steps=2)


def run_vmapped(algorithm, params, targets_R, num_steps: int, *, control=None, grad=None):
    """``num_steps`` of ``algorithm`` under ``jax.vmap`` (axis ``replica``), replica ``r``
    minimising ``0.5 |x - targets_R[r]|^2`` (or ``grad(params, target)``) from ``params``.
    ``control``: a dict of StepControl masks ``[num_steps, R]``. Returns the parameters after
    every step (leading ``[T, R]``), the final state and the stacked metrics."""
    replicas = jax.tree.leaves(targets_R)[0].shape[0]
    state = init_replicas(algorithm, params, replicas)
    axes = algorithm_lib.vmap_axes(algorithm)
    grad = grad or (lambda x, t: jax.tree.map(jnp.subtract, x, t))

    def one(state, target, ctrl):
        return algorithm.update(state, grad(state.params, target), **ctrl)

    step = jax.jit(jax.vmap(one, in_axes=(axes, 0, 0), out_axes=(axes, 0), axis_name="replica"))
    if control is None:
        control = full_control(num_steps, replicas).update_masks()
    trajectory, metrics = [], []
    for t in range(num_steps):
        ctrl = {k: jnp.asarray(v[t]) for k, v in control.items() if k != "seed"}  # no sampling
        state, m = step(state, targets_R, ctrl)
        trajectory.append(jax.device_get(state.params))
        metrics.append(jax.device_get(m))
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *trajectory)
    return stacked, jax.device_get(state), jax.tree.map(lambda *xs: np.stack(xs), *metrics)


def tf_events(workdir: pathlib.Path) -> list:
    """Every event of ``workdir/tensorboard`` (TFRecord framing: length, its crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted((workdir / "tensorboard").glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            events.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
            i += 12 + n + 4
    return events


def tb_series(events) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of TensorBoard ``events``."""
    out = {}
    for event in events:
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def tb_hparams(events) -> list:
    """The hparams of each session start in TensorBoard ``events`` (a protobuf map each)."""
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    return [HParamsPluginData.FromString(v.metadata.plugin_data.content).session_start_info.hparams
            for e in events for v in e.summary.value
            if v.tag == "_hparams_/session_start_info"]  # fmt: skip


def run_records(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "run_record.jsonl").read_text().splitlines()]


def skew_last_device(x):
    """``x`` with the copy (or part) held by its last device off by one ulp in its first value."""
    parts = []
    for i, shard in enumerate(x.addressable_shards):
        data = np.array(shard.data)
        if i == len(x.addressable_shards) - 1:
            data.reshape(-1)[0] = np.nextafter(data.reshape(-1)[0], np.float32(100))
        parts.append(jax.device_put(data, shard.device))
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, parts)


def assert_streamed_equals_loaded(cfg_for_budget, budget_mib: float, tmp_path: pathlib.Path):
    """A run streaming its training data (``data.max_memory_mib = budget_mib``) trains the
    loaded run's state bitwise, and resumes bitwise after losing its last checkpoint (step 20).
    ``cfg_for_budget(budget)`` is the run's config; returns the streamed run's first Setup."""
    import shutil

    import chex

    from diloco_jax.run.setup import build
    from diloco_jax.train import train

    setup = build(cfg_for_budget(budget_mib))
    assert setup.stream is not None
    loaded = train(cfg_for_budget(0), tmp_path / "loaded", show_progress=False)
    workdir = tmp_path / "streamed"
    whole = train(cfg_for_budget(budget_mib), workdir, show_progress=False)
    chex.assert_trees_all_equal(jax.device_get(whole["state"]), jax.device_get(loaded["state"]))
    shutil.rmtree(workdir / "checkpoints" / "20")  # as if it had died after step 10
    resumed = train(cfg_for_budget(budget_mib), workdir, show_progress=False)
    assert resumed["steps"] == 20
    chex.assert_trees_all_equal(jax.device_get(resumed["state"]), jax.device_get(loaded["state"]))
    return setup


def assert_close_but_for_code_steps(got, want, *, step, max_share, rtol=1e-5, atol=1e-6,
                                    msg="") -> int:  # fmt: skip
    """Two layouts (or runtimes) compared through a lossy codec: ``got`` equals ``want`` to
    float32 rounding (``rtol``, ``atol``) but for at most ``max_share`` of all their values, each
    of which may be off by at most ``step`` (a number, or a tree like ``want``: one per leaf).

    Why a share: two programs that sum in another order (a vmap of another size, another CPU's
    kernels) give pseudo-gradients a last bit apart. The codec rounds both alike except where a
    value sits on a rounding boundary (an int8 code's .5, a top-k near-tie), where the last bit
    becomes a whole quantization step. Those values are few; a real divergence (a replica
    encoding another's pseudo-gradient, a residual not kept) moves most values. Returns how many
    values were off by more than rounding."""
    want_leaves, treedef = jax.tree.flatten(want)
    got_leaves = treedef.flatten_up_to(got)
    step_leaves = ([step] * len(want_leaves) if np.ndim(step) == 0 and not isinstance(step, list)
                   else treedef.flatten_up_to(step))  # fmt: skip
    off, total = 0, 0
    for path_want, g, s in zip(jax.tree_util.tree_leaves_with_path(want), got_leaves, step_leaves,
                               strict=True):  # fmt: skip
        path, w = path_want
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        assert g.shape == w.shape, f"{msg}{jax.tree_util.keystr(path)}: {g.shape} != {w.shape}"
        diff = np.abs(g - w)
        rounding = diff <= atol + rtol * np.abs(w)
        worst = float(diff.max(initial=0.0))
        assert worst <= float(s) + atol, (
            f"{msg}{jax.tree_util.keystr(path)}: off by {worst:.3g}, more than the codec's "
            f"step {float(s):.3g}"
        )
        off += int((~rounding).sum())
        total += w.size
    assert off <= max_share * total, (
        f"{msg}{off} of {total} values off by more than rounding (rtol {rtol}, atol {atol}); "
        f"at most {max_share:.2%} may sit on a rounding boundary of the codec"
    )
    return off


_DRAWS = loop_module.draws  # whether a run draws its figures, as the library decides


def no_figures() -> None:
    """The session's runs draw no figures (tests/conftest.py): a run's drift.png and cosine.png
    cost about 0.5 s of CPU each time, and the suite trains a few hundred runs."""
    pytest.MonkeyPatch().setattr(loop_module, "draws", lambda s: False)


@contextlib.contextmanager
def drawing_figures():
    """Runs inside draw their figures as the library decides (for the tests that read them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop_module, "draws", _DRAWS)
        yield
