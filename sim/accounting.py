"""What a run of a sweep cost: exact bytes of its syncs, and its simulated wall-clock and
utilization on the configured network (``sim/clock.py``), as a row of the sweep's results."""

from __future__ import annotations

import jax

from diloco_jax import config as config_lib
from diloco_jax.algorithm.compress import CODECS
from diloco_jax.algorithm.plan import SyncPlan
from diloco_jax.simulated import comms, schedule
from diloco_jax.watch.reporting import eval_metrics

from . import clock


def codec_label(cfg: config_lib.Config) -> str:
    """How the run's pseudo-gradients travel, its other communication variants and the
    optimizers when they are not the paper's, e.g. ``int4+ef``, ``none,F=4,tau=2,alpha=0.5``,
    ``none,eager``, ``none,desloc(150/300)``, ``none,inner=muon`` or ``none,outer=adam``."""
    c, st = cfg.compress, cfg.streaming
    label = c.codec + ("+ef" if c.error_feedback and c.codec in CODECS[1:] else "")
    if c.codec == "dct":
        label += f"(k={c.dct_topk}/{c.dct_chunk},beta={c.dct_beta:g})"
    if c.codec == "sparseloco":
        label += f"(k={c.sparse_topk}/{c.sparse_chunk},beta={c.sparse_beta:g},{c.sparse_bits}b)"
    if st.fragments > 1 or st.overlap:
        label += f",F={st.fragments},tau={st.overlap},alpha={st.mix:g}"
    if cfg.outer.mode != "sync":
        label += f",{cfg.outer.mode}"
    if cfg.noloco.enabled:
        label += f",noloco(pull={cfg.noloco.pull:g})"
    d = cfg.desloc
    if d.first_moment_every or d.second_moment_every:
        label += f",desloc({d.first_moment_every}/{d.second_moment_every})"
    if cfg.inner.optimizer != "adamw":
        label += f",inner={cfg.inner.optimizer}"
    if cfg.outer.optimizer != "sgd":
        label += f",outer={cfg.outer.optimizer}"
    if cfg.sim.quorum and cfg.algorithm == "diloco":
        label += f",quorum={cfg.sim.quorum}(grace={cfg.sim.grace:g})"
    return label


def _hidden_steps(cfg: config_lib.Config) -> int:
    """Inner steps of compute that one reduce overlaps (see ``sim/clock.py``)."""
    if cfg.algorithm != "diloco":
        return 0
    return cfg.outer.sync_every if cfg.outer.mode != "sync" else cfg.streaming.overlap


def _moment_payloads(cfg: config_lib.Config, params) -> list[tuple[int, int]]:
    """``(every, P)`` of each moment kind DES-LOC averages (``cfg.desloc``): the float leaves
    of the inner optimizer's state that one average sends."""
    from diloco_jax.algorithm import moments
    from diloco_jax.config.recipe import inner_of

    d = cfg.desloc
    periods = (("first", d.first_moment_every), ("second", d.second_moment_every))
    if not any(every for _, every in periods):
        return []
    state = jax.eval_shape(inner_of(cfg).init, params)
    return [(every, comms.payload_bytes(moments.payload_leaves(state, which)))
            for which, every in periods if every]  # fmt: skip


def _quorum_bytes(cfg: config_lib.Config, steps: int, payload: int, replicas: int):
    """``(bytes per replica of each sync, the most one replica sends at one)`` with a quorum:
    only the replicas that join a sync reduce, among themselves
    (:func:`diloco_jax.simulated.schedule.quorum_rounds`); a late replica sends nothing."""
    sim = cfg.sim
    rounds = schedule.quorum_rounds(schedule.parse_speeds(sim.speeds, replicas),
                                    cfg.outer.sync_every, sim.quorum, sim.grace,
                                    steps // cfg.outer.sync_every)  # fmt: skip
    each = [comms.bytes_per_replica(payload, int(m.sum()), sim.topology) for m in rounds.merged]
    sync_bytes = [b * int(m.sum()) / replicas for b, m in zip(each, rounds.merged, strict=True)]
    return sync_bytes, max(each, default=0)


def account(done: dict, cfg: config_lib.Config, params) -> dict:
    """A results row: losses, exact bytes, and the network clock (``params``: the model's, whose
    size and dtypes give the bytes)."""
    replicas = 1 if cfg.algorithm == "single" else cfg.parallel.replicas
    steps, sim = done["steps"], cfg.sim
    from diloco_jax.config.recipe import sync_payloads

    diloco = cfg.algorithm == "diloco"
    num_fragments = cfg.streaming.fragments if diloco else 1
    payloads, topology = sync_payloads(cfg, params, replicas)
    fp32_payload = comms.payload_bytes(params)
    if diloco:
        events = comms.diloco_sync_events(steps, cfg.outer.sync_every, num_fragments)
    else:
        events = [0] * comms.reduces(cfg.algorithm, steps, cfg.outer.sync_every)
    syncs = len(events)
    per_sync = [comms.bytes_per_replica(p, replicas, topology) for p in payloads]
    extra = _moment_payloads(cfg, params) if diloco else []
    sync_bytes = [per_sync[f] + sum(comms.bytes_per_replica(p, replicas, sim.topology)
                                    for every, p in extra if step % every == 0)
                  for step, f in SyncPlan(cfg.outer.sync_every, num_fragments).sync_steps(1, steps)
                  ] if diloco else [per_sync[f] for f in events]  # fmt: skip
    peak = max(sync_bytes) if syncs else 0
    if diloco and sim.quorum:
        sync_bytes, peak = _quorum_bytes(cfg, steps, payloads[0], replicas)
    sent = sum(sync_bytes)
    ddp_sent = steps * comms.bytes_per_replica(fp32_payload, cfg.parallel.replicas, sim.topology)
    preset = comms.NETWORKS[sim.network]
    network = comms.Network(
        sim.bandwidth_gbps or preset.bandwidth_gbps,
        sim.latency_ms if sim.latency_ms >= 0 else preset.latency_ms,
    )
    # one device ran all replicas: one replica on its own device takes 1/R of that time
    step_time = sim.step_time_s or done["step_seconds"] / replicas
    c = clock.simulate(
        algorithm=cfg.algorithm, steps=steps, sync_every=cfg.outer.sync_every, replicas=replicas,
        speeds=schedule.parse_speeds(sim.speeds, cfg.parallel.replicas)[:replicas],
        dylu=sim.dylu, step_time_s=step_time, payload_bytes=payloads, network=network,
        topology=topology, fragments=num_fragments, hidden_steps=_hidden_steps(cfg),
        extra_payloads=extra, quorum=(sim.quorum, sim.grace) if diloco and sim.quorum else None,
    )  # fmt: skip
    losses = [e["eval_loss"] for e in done["evals"]]
    return {
        "run": done["name"], "algorithm": cfg.algorithm, "replicas": replicas,
        "sync_every": cfg.outer.sync_every if cfg.algorithm == "diloco" else 1,
        "outer_lr": cfg.outer.learning_rate, "outer_momentum": cfg.outer.momentum,
        "codec": codec_label(cfg), "seed": cfg.seed, "tokens": done["tokens"], "steps": steps,
        "final_eval_loss": done["final_eval_loss"], "best_eval_loss": min(losses),
        "syncs": syncs, "bytes_per_replica": sent,
        "peak_sync_bytes": peak,
        "bytes_per_token": sent * replicas / done["tokens"],
        "bytes_vs_ddp": sent / ddp_sent if ddp_sent else 0.0,
        "sim_wallclock_s": c.wallclock_s, "utilization": c.utilization,
        "comm_fraction": c.comm_s / c.wallclock_s, "step_time_s": step_time,
        "step_time_measured": not sim.step_time_s,  # this machine's, as loaded: see sim/sweep
        **{f"final_{k}": v for k, v in eval_metrics(done["evals"][-1]).items()},
    }  # fmt: skip
