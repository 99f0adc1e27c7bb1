"""From a config to devices: how many XLA devices the CPU is split into, how replicas map to the
devices (``parallel.*`` keys) and which runner takes the step there (simulator, chunked
simulator, mesh). Read at the edge (``diloco_jax.train``); the library functions are in
:mod:`diloco_jax.runtime`."""

from __future__ import annotations

import functools
import os

import jax

from diloco_jax import config as config_lib
from diloco_jax.run import distributed, memory
from diloco_jax.runtime import chunked, compile_cache, parallel
from diloco_jax.runtime.step import make_replica_step
from diloco_jax.simulated import schedule
from diloco_jax.watch.reporting import log


def effective_replicas(cfg: config_lib.Config) -> int:
    """Replicas the state holds: one for the single-model baseline."""
    return 1 if cfg.algorithm == "single" else cfg.parallel.replicas


def _noloco(cfg: config_lib.Config) -> bool:
    return cfg.noloco.enabled and cfg.algorithm == "diloco"


def runtime(cfg: config_lib.Config) -> str:
    """``parallel.runtime``, where ``auto`` means the simulator for a chunked one (sim.chunk),
    for NoLoCo (a mesh gives it one device per replica only when asked) and for a learner
    (``syncer.address``: its replicas on one device; a learner of several processes, or on a
    mesh of its own, sets ``parallel.runtime=mesh``)."""
    sim = cfg.sim.chunk or _noloco(cfg) or cfg.syncer.address
    return "sim" if cfg.parallel.runtime == "auto" and sim else cfg.parallel.runtime


def split_cpu(cfg: config_lib.Config) -> None:
    """Sets the CPU's XLA device count (``parallel.cpu_devices``), the persistent compilation
    cache (``train.compile_cache``) and deterministic GPU ops (``train.deterministic``); call
    before JAX starts."""
    compile_cache.enable(cfg.train.compile_cache)
    asked = parallel.deterministic_gpu(cfg.train.deterministic)
    if asked is None and jax.default_backend() == "gpu":
        log.warning("train.deterministic: JAX had started before this run, too late to ask XLA "
                    "for deterministic GPU ops; set XLA_FLAGS=--xla_gpu_deterministic_ops=true "
                    "before JAX starts for equal bits run to run")  # fmt: skip
    p = cfg.parallel
    auto = parallel.cpu_devices_for(replicas=effective_replicas(cfg), runtime=runtime(cfg),
                                    replica_devices=p.replica_devices,
                                    data_devices=p.data_devices)  # fmt: skip
    try:
        split = parallel.split_cpu(p.cpu_devices, auto=auto)
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from None
    if not split and not p.cpu_devices and auto > 1 and _too_late_to_split(auto):
        log.warning("JAX started before this run with %d CPU device(s), too late to split the "
                    "CPU into %d: the replicas share what there is (parallel.runtime = auto "
                    "picks the simulator on one device); to split it, train before other JAX "
                    "work or set XLA_FLAGS=--xla_force_host_platform_device_count=%d first",
                    len(jax.devices("cpu")), auto, auto)  # fmt: skip


def _too_late_to_split(auto: int) -> bool:
    """Whether JAX runs on the CPU with fewer devices than ``auto`` although nobody chose that
    count (a user's own JAX work started JAX before the run)."""
    if parallel._count_set_by_user(os.environ) or jax.distributed.is_initialized():
        return False
    return jax.default_backend() == "cpu" and len(jax.devices("cpu")) < auto


def layout(cfg: config_lib.Config, replicas: int) -> parallel.Layout:
    """How ``replicas`` map to the devices (:func:`split_cpu` first: JAX starts here)."""
    p = cfg.parallel
    split_cpu(cfg)
    try:
        layout = parallel.resolve_layout(
            replicas=replicas, batch_size=cfg.data.batch_size, runtime=runtime(cfg),
            replica_devices=p.replica_devices, data_devices=p.data_devices, fsdp=p.fsdp,
        )  # fmt: skip
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from None
    if _noloco(cfg) and layout.runtime == "mesh" and layout.replica_devices != replicas:
        raise config_lib.ConfigError(
            f"config key parallel.replica_devices = {layout.replica_devices} is invalid with "
            f"noloco.enabled: NoLoCo pairs replicas over the device axis, so each of the "
            f"{replicas} replicas needs its own device (or parallel.runtime = sim)"
        )
    if layout.runtime == "sim" and jax.process_count() > 1:
        raise config_lib.ConfigError(
            f"config key parallel.runtime = {p.runtime!r} is invalid with "
            f"{jax.process_count()} processes: the simulator runs in one process; use mesh"
        )
    return layout


def steps(cfg: config_lib.Config, layout, algorithm, problem, mesh, state):
    """The compiled call of ``train.log_every`` steps (simulator, chunked simulator or mesh),
    the function giving the parameters to evaluate, and the devices' fingerprints (mesh)."""
    make_step = functools.partial(
        make_replica_step,
        task=problem.task,
        batch_size=cfg.data.batch_size,
        data_axis=parallel.DATA if mesh is not None and layout.data_devices > 1 else None,
        dropout=problem.task.rng or (cfg.model.dropout > 0 and problem.task.unit == "token"),
        controlled=schedule.needs_control(speeds=cfg.sim.speeds, dylu=cfg.sim.dylu,
                                          drop=cfg.sim.drop, drop_prob=cfg.sim.drop_prob,
                                          quorum=cfg.sim.quorum),
        streamed=problem.streamed,
    )  # fmt: skip
    steps, kinds, streamed = cfg.train.log_every, algorithm.kinds, problem.streamed
    if mesh is None and cfg.sim.chunk:
        run = chunked.ChunkedSteps(make_step(chunked.LocalOnly(algorithm)), algorithm, steps,
                                   chunk=cfg.sim.chunk, offload=cfg.sim.offload,
                                   per_step_data=streamed)  # fmt: skip
        return run, algorithm.outer_params, None
    if mesh is None:
        local = chunked.LocalOnly(algorithm) if cfg.syncer.address else algorithm  # a learner
        run = parallel.simulator_steps(make_step(local), kinds, steps, per_step_data=streamed)
        return run, algorithm.outer_params, None
    specs = parallel.state_specs(state, kinds, layout)
    local = chunked.LocalOnly(algorithm) if cfg.syncer.address else algorithm  # a learner
    run = parallel.mesh_steps(make_step(local), kinds, mesh, steps, per_step_data=streamed,
                              fsdp_specs=specs)  # fmt: skip
    outer_fn = jax.jit(algorithm.outer_params, out_shardings=parallel.replicated_sharding(mesh))
    return run, outer_fn, distributed.make_device_fingerprints(mesh, split=layout.fsdp)


def cpu_simulation() -> bool:
    """One process on CPU devices: every collective stays in this machine's memory."""
    return jax.process_count() == 1 and jax.default_backend() == "cpu"


def memory_plan(s, compiled) -> memory.MemoryPlan:
    """The memory plan of ``s`` (a ``run_setup.Setup``, abstract or not) for its ``compiled``
    call."""
    limit = memory.device_limit(jax.local_devices()[0], s.cfg.parallel.device_memory_gib)
    data = {"training data": s.shards_RxS, "replica ids": s.replicas_R}
    # the chunked simulator with sim.offload holds one chunk's state on the device
    state = getattr(s.run_chunk, "on_device", lambda state: state)(s.state)
    return memory.plan(state, data, compiled, limit,
                       resident={"evaluation data": s.eval_windows})  # fmt: skip


def check_fits(plan: memory.MemoryPlan, s) -> None:
    """Raises ConfigError (one line) if ``plan`` does not fit its device, naming the settings
    that would shrink it and are not taken yet (``s``: the run's ``Setup``)."""
    if not plan.fits:
        transformer = s.unit == "token" and s.graphdef is not None
        ways = ", ".join(shrinking(s.cfg, s.layout, transformer=transformer))
        raise config_lib.ConfigError(
            f"the run needs {memory.size(plan.total)} per device, more than the "
            f"{memory.size(plan.limit or 0)} of one device ({plan.limit_source}); to shrink it: "
            f"{ways} (the plan: --dry_run)"
        )


def shrinking(cfg: config_lib.Config, layout, *, transformer: bool) -> list[str]:
    """What would make a run take less memory per device, in words naming the config keys,
    leaving out what it does already (``transformer``: the built-in language model, which
    ``model.remat`` applies to)."""
    ways = []
    if layout.runtime == "sim":  # every replica on one device, vmapped
        if not cfg.sim.chunk:
            ways.append("sim.chunk=K (K replicas at a time; with sim.offload=true the others' "
                        "state waits in host memory)")  # fmt: skip
        elif not cfg.sim.offload:
            ways.append("sim.offload=true (the replicas' state waits in host memory)")
        ways.append("parallel.runtime=mesh (replicas on several devices)")
    else:
        per_device = layout.replicas // max(layout.replica_devices, 1)
        if per_device > 1:
            ways.append(f"fewer replicas per device (parallel.replica_devices, {per_device} "
                        "replicas a device now)")  # fmt: skip
        if not layout.fsdp:
            ways.append("parallel.fsdp=true with parallel.data_devices > 1 (a replica's state "
                        "split over its devices)")  # fmt: skip
    if cfg.data.batch_size > 1:
        ways.append(f"a smaller data.batch_size (now {cfg.data.batch_size})")
    if transformer and not cfg.model.remat:
        ways.append("model.remat=true")
    return [*ways, "a smaller model"]


def check_memory(s, compiled) -> None:
    """Logs the memory plan's total; if the run does not fit, logs the whole plan and raises
    ConfigError (one line)."""
    plan = memory_plan(s, compiled)
    if plan.fits:
        log.info("%s", plan.summary())
        return
    log.error("%s", plan.table())
    check_fits(plan, s)
