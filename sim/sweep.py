"""Sweeps: run config variants as vmapped virtual workers, account bytes and time, tabulate.

Every run is ``diloco_jax.train.train`` with ``parallel.runtime=sim``: the same train step as
multi-device training, never a copy. A run whose ``summary.json`` exists with the same config is
not recomputed.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import pathlib
import shutil
import sys
from collections import defaultdict

import jax
import numpy as np

from diloco_jax import comms, extras, schedule
from diloco_jax import config as config_lib
from diloco_jax.algorithm import gossip
from diloco_jax.algorithm.compress import CODECS
from diloco_jax.algorithm.plan import SyncPlan
from diloco_jax.reporting import log

from . import clock, plots

COLUMNS = [
    "run", "algorithm", "replicas", "sync_every", "outer_lr", "outer_momentum", "codec", "seed",
    "tokens", "steps", "final_eval_loss", "best_eval_loss", "syncs", "bytes_per_replica",
    "peak_sync_bytes",
    "bytes_per_token", "bytes_vs_ddp", "sim_wallclock_s", "utilization", "comm_fraction",
    "step_time_s",
]  # fmt: skip


def _split_values(text: str) -> list[str]:
    """``"1,[1,0.5],[]"`` -> ``["1", "1,0.5", ""]``: commas inside ``[ ]`` do not split, and a
    value wholly in brackets is what they hold (``[]``: the empty string)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or (i == len(text) and depth):
            raise ValueError("unbalanced [ ]")
        if char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    values = []
    for item in items:
        if not item:
            raise ValueError("an empty value (write [] for the empty string)")
        whole = item.startswith("[") and item.endswith("]") and "]" not in item[1:-1]
        values.append(item[1:-1].strip() if whole else item)
    return values


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """``"outer.sync_every=1,10,50"`` -> ``("outer.sync_every", ["1", "10", "50"])``. A value that
    holds commas (a list-valued key) goes in brackets: ``"sim.speeds=[1,1,0.5],[1,0.5,0.5],[]"``
    -> ``("sim.speeds", ["1,1,0.5", "1,0.5,0.5", ""])``. Raises :class:`ConfigError` (one line)
    for an unknown key, an empty or repeated value, unbalanced brackets."""
    key, eq, values = text.partition("=")
    key = key.strip()
    usage = "use KEY=V1,V2,... (e.g. outer.sync_every=1,10; sim.speeds=[1,0.5],[1,1])"
    if not eq or not key or not values.strip():
        raise config_lib.ConfigError(f"--sweep {text!r}: {usage}")
    if key not in config_lib.keys():
        try:
            config_lib.override(config_lib.Config(), key, "")  # raises, naming the closest key
        except config_lib.ConfigError as e:
            raise config_lib.ConfigError(f"--sweep {text!r}: {e}") from None
    if key in ("seed", "parallel.runtime"):
        raise config_lib.ConfigError(
            f"--sweep {text!r}: {key} is set by the simulator"
            + (" (use --seeds)" if key == "seed" else "")
        )
    try:
        parsed = _split_values(values)
    except ValueError as e:
        raise config_lib.ConfigError(f"--sweep {text!r}: {e}; {usage}") from None
    repeated = sorted({v for v in parsed if parsed.count(v) > 1})
    if repeated:
        raise config_lib.ConfigError(f"--sweep {text!r}: value {repeated[0]!r} is listed twice")
    return key, parsed


def _label(key: str, value: str) -> str:
    """How one swept value names its runs: ``speeds=[1,0.5]`` for a value with commas."""
    return f"{key.split('.')[-1]}=" + (f"[{value}]" if "," in value or not value else value)


def plan(base: config_lib.Config, sweeps: list[str], baselines: list[str], seeds: list[int]):
    """``[(name, group, config)]`` for the grid of ``sweeps`` x ``seeds`` plus the baselines;
    every config is validated here, before anything runs or is written."""
    axes = [parse_sweep(s) for s in sweeps]
    swept = [k for k, _ in axes]
    twice = sorted({k for k in swept if swept.count(k) > 1})
    if twice:
        raise config_lib.ConfigError(f"--sweep: {twice[0]} is swept twice (one --sweep per key)")
    if not seeds:
        raise config_lib.ConfigError("--seeds: no seeds")
    variants = []
    for point in itertools.product(*[[(k, v) for v in vals] for k, vals in axes]):
        group = ",".join(_label(k, v) for k, v in point) or "diloco"
        variants.append((group, list(point)))
    for name in baselines:
        if baselines.count(name) > 1:
            raise config_lib.ConfigError(f"--baselines: {name!r} is listed twice")
        if name not in ("single", "ddp"):
            raise config_lib.ConfigError(f"--baselines: {name!r} is not one of single, ddp")
        variants.append((name, [("algorithm", name)]))
    runs = []
    for (group, overrides), seed in itertools.product(variants, seeds):
        cfg = config_lib.apply_overrides(
            base, [*overrides, ("seed", str(seed)), ("parallel.runtime", "sim")]
        )
        config_lib.validate(cfg)
        name = group if len(seeds) == 1 else f"{group},seed={seed}"
        runs.append((name, group, cfg))
    return runs


# Keys that only change the accounting (bytes, clock), not what is trained: a finished run is
# reused when they change, so one sweep can be re-accounted for another network.
ACCOUNTING_KEYS = ("network", "bandwidth_gbps", "latency_ms", "topology", "step_time_s")


def _training_part(cfg_dict: dict) -> dict:
    """The config without accounting keys; keys the run's code did not have yet take today's
    defaults (a config key added later does not invalidate finished runs)."""
    merged = {}
    for section, default in config_lib.to_dict(config_lib.Config()).items():
        value = cfg_dict.get(section, default)
        merged[section] = {**default, **value} if isinstance(default, dict) else value
    merged["sim"] = {k: v for k, v in merged["sim"].items() if k not in ACCOUNTING_KEYS}
    return merged


def run_one(name: str, cfg: config_lib.Config, rundir: pathlib.Path) -> dict:
    """Trains one variant into ``rundir`` unless it already finished there with this config."""
    from diloco_jax.train import train

    summary_path = rundir / "summary.json"
    cfg_dict = config_lib.to_dict(cfg)
    if summary_path.exists():
        done = json.loads(summary_path.read_text())
        if _training_part(done["config"]) == _training_part(cfg_dict):
            return {**done, "config": cfg_dict}
        raise config_lib.ConfigError(
            f"{rundir} holds run {name!r} with another config; use another --workdir"
        )
    if rundir.exists():  # an unfinished attempt: start it again from scratch
        shutil.rmtree(rundir)
    summary = train(cfg, rundir, show_progress=False)
    if summary["preempted"]:
        return None  # stopped by a signal: the sweep stops; its checkpoint resumes it next time
    summary.pop("state")
    summary.pop("sample", None)
    events = [json.loads(line) for line in (rundir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    done = {"name": name, "config": cfg_dict, **summary, "evals": evals}
    summary_path.write_text(json.dumps(done, indent=1) + "\n")
    return done


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
    from diloco_jax.recipe import inner_of

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
    (:func:`diloco_jax.schedule.quorum_rounds`); a late replica sends nothing."""
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
    from diloco_jax.recipe import codec_of, dct_of

    diloco = cfg.algorithm == "diloco"
    num_fragments = cfg.streaming.fragments if diloco else 1
    payloads = comms.sync_payloads(
        params, codec_of(cfg) if diloco else None, replicas,
        dct_config=dct_of(cfg) if diloco else None, num_fragments=num_fragments,
    )  # fmt: skip
    fp32_payload = comms.payload_bytes(params)
    if diloco:
        events = comms.diloco_sync_events(steps, cfg.outer.sync_every, num_fragments)
    else:
        events = [0] * comms.reduces(cfg.algorithm, steps, cfg.outer.sync_every)
    topology = sim.topology
    if diloco and cfg.noloco.enabled:  # pseudo-gradient and anchor to one partner
        payloads, topology = [gossip.pair_payload(params)], comms.PAIRWISE
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
    }  # fmt: skip


def summarize(rows: list[dict], groups: dict[str, str]) -> list[dict]:
    """Mean and spread (std over seeds) per group."""
    by_group = defaultdict(list)
    for row in rows:
        by_group[groups[row["run"]]].append(row)
    table = []
    for group, members in by_group.items():
        losses = np.array([m["final_eval_loss"] for m in members])
        first = members[0]
        table.append({
            "run": group, "seeds": len(members), "replicas": first["replicas"],
            "sync_every": first["sync_every"], "outer_lr": first["outer_lr"],
            "codec": first["codec"], "tokens": first["tokens"],
            "final_eval_loss": float(losses.mean()),
            "final_eval_loss_std": float(losses.std()),
            "best_eval_loss": float(np.mean([m["best_eval_loss"] for m in members])),
            "bytes_per_replica": first["bytes_per_replica"], "bytes_vs_ddp": first["bytes_vs_ddp"],
            "peak_sync_bytes": first["peak_sync_bytes"],
            "sim_wallclock_s": float(np.mean([m["sim_wallclock_s"] for m in members])),
            "utilization": float(np.mean([m["utilization"] for m in members])),
        })  # fmt: skip
    return table


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def format_table(table: list[dict]) -> str:
    head = ("run", "final loss", "best", "tokens", "bytes/replica", "vs ddp", "sim wall-clock",
            "util")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in table:
        spread = f" ± {t['final_eval_loss_std']:.3f}" if t["seeds"] > 1 else ""
        lines.append(
            f"| {t['run']} | {t['final_eval_loss']:.3f}{spread} | {t['best_eval_loss']:.3f} | "
            f"{t['tokens']:,} | {t['bytes_per_replica']:.3g} | {t['bytes_vs_ddp']:.3g} | "
            f"{t['sim_wallclock_s']:.4g}s | {t['utilization']:.2f} |"
        )
    return "\n".join(lines)


def mean_curves(dones: list[dict], groups: dict[str, str]) -> dict[str, dict]:
    by_group = defaultdict(list)
    for done in dones:
        by_group[groups[done["name"]]].append(done["evals"])
    curves = {}
    for group, runs in by_group.items():
        n = min(len(r) for r in runs)
        curves[group] = {
            "tokens": [e["tokens"] for e in runs[0][:n]],
            "steps": [e["step"] for e in runs[0][:n]],
            "loss": np.mean([[e["eval_loss"] for e in r[:n]] for r in runs], axis=0).tolist(),
        }
    return curves


def sweep(base, workdir: pathlib.Path, *, sweeps, baselines, seeds, show_progress=True) -> list:
    """Runs the plan, writes results.csv, summary.csv, curves.png, tradeoff.png (these two only
    with matplotlib, the plots extra: without it a note says so and the tables are still
    written); returns the summary table (a row per group: mean and spread over seeds)."""
    from diloco_jax import problems
    from diloco_jax.reporting import progress_bar, setup_logging

    runs = plan(base, sweeps, baselines, seeds)
    for cfg in {c.data: c for c in (base, *(c for _, _, c in runs))}.values():  # data loaded
        problems.check_extras(cfg)
    draw = not extras.missing("matplotlib")
    if not draw:  # a sweep is worth its tables alone: say so at the start, not after hours
        print(f"note: curves.png and tradeoff.png are not drawn (they need matplotlib): "
              f"{extras.install_hint('matplotlib')}", file=sys.stderr)  # fmt: skip
    setup_logging(logging.WARNING)  # the sweep's bar and table say enough
    # the model's shapes give the bytes: the data decide the model (its vocabulary or classes)
    params = problems.load(base, replicas=1).params
    workdir.mkdir(parents=True, exist_ok=True)
    rows, dones, groups = [], [], {}
    bar = progress_bar(len(runs), enabled=show_progress, unit="run")
    for name, group, cfg in runs:
        bar.set_postfix_str(name)
        done = run_one(name, cfg, workdir / "runs" / name.replace("/", "_"))
        if done is None:
            bar.close()
            log.warning("sweep stopped during run %s; run the same command to continue", name)
            return []
        groups[name] = group
        dones.append(done)
        rows.append(account(done, cfg, params))
        bar.update(1)
    bar.close()
    write_csv(workdir / "results.csv", rows)
    table = summarize(rows, groups)
    write_csv(workdir / "summary.csv", table)
    written = ["results.csv", "summary.csv"]
    if draw:
        plots.curves(mean_curves(dones, groups), workdir / "curves.png")
        plots.tradeoff(table, workdir / "tradeoff.png")
        written += ["curves.png", "tradeoff.png"]
    log.warning("wrote %s", ", ".join(str(workdir / f) for f in written))
    return table
