"""A run's :class:`Setup`, built from its config before the training loop: the config
validated, the data (or a user's task) loaded, the replica-stacked state placed, the step and
the evaluation made (:func:`build`); and each call's control inputs (:func:`chunk_control`).
``diloco_jax.train`` runs the loop on it; the benchmarks and tests build one to time or check a
step."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from diloco_jax import config as config_lib
from diloco_jax.algorithm import SyncPlan, init_replicas
from diloco_jax.base.axes import REPLICA
from diloco_jax.config import problems, recipe, user_optimizers, validation
from diloco_jax.data.stream import make_stream
from diloco_jax.run import distributed, placement, resume
from diloco_jax.runtime import evaluation, parallel
from diloco_jax.runtime.step import StepControl
from diloco_jax.simulated import schedule
from diloco_jax.tasks import Task
from diloco_jax.tasks import model as model_lib
from diloco_jax.watch.reporting import log


@dataclasses.dataclass
class Setup:
    """Everything built from a config before the loop: validated, loaded, compiled."""

    cfg: config_lib.Config
    layout: parallel.Layout
    graphdef: Any
    state: Any
    mesh: Any
    run_chunk: Any  # (state, replicas_R, shards_RxS, control_NxR) -> (state, metrics_NxR)
    replicas_R: jax.Array
    shards_RxS: jax.Array  # each replica's training tokens; a process holds only its replicas'
    eval_windows: jax.Array  # replicated, or in blocks over the devices (runtime/evaluation.py)
    evaluate: Any  # params (replicated) -> {"eval_loss", ...}: runtime/evaluation.py
    unigram_nats: float
    algorithm: Any  # diloco_jax.algorithm.diloco(...) or a baseline
    task: Task
    outer_fn: Any  # state -> the parameters to evaluate, replicated
    fingerprints: Any = None  # mesh only: tree -> uint32 [devices], each device's copy
    num_params: int = 0
    tokenizer: Any = None  # the corpus's (None: bytes)
    stream: Any = None  # data.max_memory_mib: the shards stay on disk (data/stream.py)

    def data(self, step: int):
        """The data argument of the call from ``step``: the shards on the devices, or (streamed)
        the call's batches, read from disk now (``shards_RxS`` holds the first call's)."""
        if self.stream is None:
            return self.shards_RxS
        shardings = jax.tree.map(lambda x: x.sharding, self.shards_RxS)
        return self.stream.on_devices(step, shardings)

    def data_states(self) -> dict | None:
        """Every replica's pipeline state at the current step, to save with a checkpoint (a
        user's GrainTask; None for data sampled by the step)."""
        states = getattr(self.stream, "states", None)
        return None if states is None else distributed.merged(states())

    def resume_data(self, start: resume.Start) -> None:
        """Sets the pipelines where ``start`` left them (a user's GrainTask)."""
        if not hasattr(self.stream, "restore") or not start.step:
            return
        if start.data is None:
            log.warning("the checkpoint holds no pipeline states (an elastic restart): every "
                        "replica's pipeline starts again from its beginning")  # fmt: skip
        self.stream.restore(start.data, start.step)

    @property
    def tokens_per_row(self) -> int:
        """What one batch row counts as in "tokens": seq_len tokens, or one example (images)."""
        return self.task.tokens_per_row

    @property
    def unit(self) -> str:
        return self.task.unit


def _initial_state(algorithm, params, layout: parallel.Layout, mesh, abstract: bool):
    """The replica-stacked initial state, made where it lives (no device ever holds more than
    its own share), or its placed shapes (``abstract``)."""

    def init(params):
        return init_replicas(algorithm, params, layout.replicas)

    state = parallel.place(jax.eval_shape(init, params), algorithm.kinds, mesh, abstract=True,
                           fsdp_split=layout.fsdp)  # fmt: skip
    if abstract:
        return state
    params = jax.device_get(params)  # host values: replicated inputs for every process
    return jax.jit(init, out_shardings=jax.tree.map(lambda x: x.sharding, state))(params)


def _training_data(shards_RxS, stream, mesh, abstract: bool):
    """The step's data argument: the shards on the devices (each process putting only its
    replicas' rows), or, streamed, the first call's batches (which stand for every call's)."""
    if stream is None:
        return parallel.on_devices(shards_RxS, mesh, P(REPLICA), abstract=abstract)
    batches = parallel.shapes(stream.abstract(), mesh, P(None, REPLICA))
    shardings = jax.tree.map(lambda x: x.sharding, batches)
    return batches if abstract else stream.on_devices(0, shardings)


def _evaluator(problem, mesh, abstract: bool) -> tuple[Any, Any]:
    """The evaluation data where it is evaluated, and the evaluation over it."""
    devices = [] if mesh is None else list(mesh.devices.flat)
    if evaluation.applies(problem.task.eval_mean, problem.eval_data, devices):
        # each device holds and evaluates a block of the examples
        eval_windows = evaluation.place(problem.eval_data, devices, abstract=abstract)
        count = jax.tree.leaves(problem.eval_data)[0].shape[0]
        split = evaluation.split if not abstract else lambda *args: None
        return eval_windows, split(problem.task.eval_fn, eval_windows, count, devices)
    eval_windows = parallel.on_devices(problem.eval_data, mesh, P(), abstract=abstract)
    return eval_windows, evaluation.Replicated(problem.task.eval_fn, eval_windows)


def build(cfg: config_lib.Config, *, abstract: bool = False, task=None,
          given: user_optimizers.Given = user_optimizers.NONE) -> Setup:  # fmt: skip
    """Validates ``cfg``, loads data (or a user's ``task``: ArrayTask, GrainTask) and builds
    the state and the step; raises ConfigError or DataError before anything is compiled.
    ``abstract``: the state and the data as shapes with their shardings, nothing allocated.
    ``given``: the user's own optax transforms (from ``fit``), recorded in the Setup's config
    (:func:`diloco_jax.config.user_optimizers.recorded`)."""
    config_lib.validate(cfg)
    for line in validation.notices(cfg):
        log.warning("%s", line)
    problems.check_extras(cfg)
    d = cfg.data
    replicas = placement.effective_replicas(cfg)
    layout = placement.layout(cfg, replicas)
    # a learner's replicas are its part of every learner's: their data shards and indices
    first, everyone = cfg.syncer.learner * replicas, cfg.syncer.learners * replicas
    problem = problems.load(cfg, everyone, task, abstract=abstract)
    graphdef, params, shards_RxS = problem.graphdef, problem.params, problem.shards
    if everyone != replicas:
        shards_RxS = jax.tree.map(lambda x: x[first : first + replicas], shards_RxS)
    cfg = user_optimizers.recorded(cfg, given, params)
    # 1 more all-reduce per sync: only where it stays in one machine's memory
    diagnostics = cfg.sim.diagnostics and (layout.runtime == "sim" or placement.cpu_simulation())
    algorithm = recipe.algorithm_from_config(cfg, layout.replica_axis_names, diagnostics,
                                             outer_lr_as_input=True, given=given)  # fmt: skip
    if cfg.train.init_from and not abstract:  # a dry run plans with shapes
        params = resume.warm_start(cfg.train.init_from, params)
    mesh = parallel.make_mesh(layout) if layout.runtime == "mesh" else None
    state = _initial_state(algorithm, params, layout, mesh, abstract)
    steps, streamed = cfg.train.log_every, problem.streamed
    stream = None
    if problem.stream is not None:  # a user's pipelines (a learner's: its replicas' of all)
        stream = problem.stream(num_steps=steps, replicas=replicas, first_replica=first,
                                pipelines=everyone)  # fmt: skip
    elif streamed:
        stream = make_stream(shards_RxS, seed=cfg.seed, batch_size=d.batch_size,
                             seq_len=d.seq_len, num_steps=steps, first_replica=first)  # fmt: skip
    run_chunk, outer_fn, fingerprints = placement.steps(
        cfg, layout, algorithm, problem, mesh, state
    )
    eval_windows, evaluate = _evaluator(problem, mesh, abstract)
    replicas_R = np.arange(first, first + replicas, dtype=np.int32)
    return Setup(
        cfg=cfg, layout=layout, graphdef=graphdef, state=state, mesh=mesh, run_chunk=run_chunk,
        replicas_R=parallel.on_devices(replicas_R, mesh, P(REPLICA), abstract=abstract),
        shards_RxS=_training_data(shards_RxS, stream, mesh, abstract),
        eval_windows=eval_windows, evaluate=evaluate, unigram_nats=problem.baseline_nats,
        algorithm=algorithm, task=problem.task, outer_fn=outer_fn, fingerprints=fingerprints,
        num_params=model_lib.count_params(params), tokenizer=problem.tokenizer, stream=stream,
    )  # fmt: skip


def chunk_control(cfg: config_lib.Config, s: Setup, start: int,
                  outer_scale: float = 1.0) -> StepControl:  # fmt: skip
    """Stragglers' and failures' masks for the ``log_every`` steps from ``start``, the seed,
    and the outer step's scale: the outer learning rate where the step takes it as an input
    (:func:`diloco_jax.config.recipe.outer_lr_input`) times ``outer_scale``, its scale changed over
    HTTP (:mod:`diloco_jax.run.live`)."""
    replicas = s.layout.replicas
    masks: dict[str, Any] = schedule.control(
        start, cfg.train.log_every, replicas=replicas,
        plan=getattr(s.algorithm, "plan", SyncPlan(cfg.outer.sync_every)),  # baselines: rounds
        speeds=schedule.parse_speeds(cfg.sim.speeds, replicas), dylu=cfg.sim.dylu,
        drops=schedule.parse_drops(cfg.sim.drop, replicas), drop_prob=cfg.sim.drop_prob,
        seed=cfg.seed, quorum=cfg.sim.quorum, grace=cfg.sim.grace,
    )  # fmt: skip
    masks["outer_scale"][:] = recipe.outer_lr_input(cfg) * outer_scale
    return parallel.split_over_replicas(StepControl(**masks), s.mesh, axis=1)
