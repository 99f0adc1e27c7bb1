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

import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.base import extras
from diloco_jax.watch import figures
from diloco_jax.watch.reporting import BOOKKEEPING, log

from . import plots
from .accounting import account

COLUMNS = [
    "run", "algorithm", "replicas", "sync_every", "outer_lr", "outer_momentum", "codec", "seed",
    "tokens", "steps", "final_eval_loss", "best_eval_loss", "syncs", "bytes_per_replica",
    "peak_sync_bytes",
    "bytes_per_token", "bytes_vs_ddp", "sim_wallclock_s", "utilization", "comm_fraction",
    "step_time_s", "step_time_measured",
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


# Keys that only change the accounting (bytes, clock) or the figures, not what is trained: a
# finished run is reused when they change, so one sweep can be re-accounted for another network.
ACCOUNTING_KEYS = ("network", "bandwidth_gbps", "latency_ms", "topology", "step_time_s",
                   "plot_metric", "plot_label")  # fmt: skip


def _training_part(cfg_dict: dict) -> dict:
    """The config without accounting keys; keys the run's code did not have yet take today's
    defaults (a config key added later does not invalidate finished runs)."""
    merged = {}
    for section, default in config_lib.to_dict(config_lib.Config()).items():
        value = cfg_dict.get(section, default)
        merged[section] = {**default, **value} if isinstance(default, dict) else value
    merged["sim"] = {k: v for k, v in merged["sim"].items() if k not in ACCOUNTING_KEYS}
    return merged


def run_one(name: str, cfg: config_lib.Config, rundir: pathlib.Path, server=None,
            task=None, given=None) -> dict:  # fmt: skip
    """Trains one variant into ``rundir`` unless it already finished there with this config
    and task (``server``: the sweep's, which shows the run while it trains; ``task``: a user's
    ArrayTask or GrainTask, else the config's; ``given``: the user's own optax transforms,
    :class:`diloco_jax.config.user_optimizers.Given`, recorded in ``cfg`` already)."""
    from diloco_jax.train import train

    summary_path = rundir / "summary.json"
    cfg_dict = config_lib.to_dict(cfg)
    mark = None if task is None else task.fingerprint()
    if summary_path.exists():
        done = json.loads(summary_path.read_text())
        if (_training_part(done["config"]) == _training_part(cfg_dict)
                and done.get("task") == mark):  # fmt: skip
            return {**done, "config": cfg_dict}
        raise config_lib.ConfigError(
            f"{rundir} holds run {name!r} with another config or task; use another --workdir"
        )
    if rundir.exists():  # an unfinished attempt: start it again from scratch
        shutil.rmtree(rundir)
    inner, outer = given or (None, None)
    summary = train(cfg, rundir, show_progress=False, server=server, task=task, inner=inner,
                    outer=outer)  # fmt: skip
    if summary["preempted"]:
        return None  # stopped by a signal: the sweep stops; its checkpoint resumes it next time
    for key in ("state", "sample", "params"):
        summary.pop(key, None)
    events = [json.loads(line) for line in (rundir / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    done = {"name": name, "config": cfg_dict, **summary, "evals": evals, "task": mark}
    summary_path.write_text(json.dumps(done, indent=1) + "\n")
    return done


def summarize(rows: list[dict], groups: dict[str, str]) -> list[dict]:
    """Mean and spread (std over seeds) per group, for the final eval loss and every other
    value the evaluation returned (``final_accuracy``, ``final_accuracy_std``, ...); the
    simulated wall-clock's mean and its min and max over seeds, and whether it came from a
    measured step time (which the machine's load changes: :data:`WALLCLOCK_NOTE`)."""
    by_group = defaultdict(list)
    for row in rows:
        by_group[groups[row["run"]]].append(row)
    table = []
    for group, members in by_group.items():
        losses = np.array([m["final_eval_loss"] for m in members])
        wallclock = np.array([m["sim_wallclock_s"] for m in members])
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
            "sim_wallclock_s": float(wallclock.mean()),
            "sim_wallclock_s_min": float(wallclock.min()),
            "sim_wallclock_s_max": float(wallclock.max()),
            "step_time_measured": any(m["step_time_measured"] for m in members),
            "utilization": float(np.mean([m["utilization"] for m in members])),
        })  # fmt: skip
        for key in [k for k in first if k.startswith("final_") and k != "final_eval_loss"]:
            values = np.array([m[key] for m in members if key in m])
            table[-1][key], table[-1][f"{key}_std"] = float(values.mean()), float(values.std())
    return table


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


WALLCLOCK_NOTE = (
    "sim wall-clock (mean, min-max over seeds) from the step time measured on this machine "
    "(sim.step_time_s = 0), which its load changes, seed to seed; model one replica's inner "
    "step instead: --config.sim.step_time_s=SECONDS (then equal for every seed)"
)


def wallclock_cell(row: dict) -> str:
    """The simulated wall-clock of a summary row in seconds: ``21.4`` or, where its seeds
    differ, ``21.4 (18.2-25.1)`` (the mean, then the min and max over seeds)."""
    low, high = row.get("sim_wallclock_s_min"), row.get("sim_wallclock_s_max")
    spread = f" ({low:.3g}-{high:.3g})" if low is not None and high > low else ""
    return f"{row['sim_wallclock_s']:.4g}{spread}"


def wallclock_note(rows: list[dict]) -> str:
    """:data:`WALLCLOCK_NOTE` as a line under a table, where a row's wall-clock came from a
    measured step time; else nothing."""
    return f"\nnote: {WALLCLOCK_NOTE}\n" if any(r.get("step_time_measured") for r in rows) else ""


def format_table(table: list[dict]) -> str:
    head = ("run", "final loss", "best", "tokens", "bytes/replica", "vs ddp", "sim wall-clock (s)",
            "util")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in table:
        spread = f" ± {t['final_eval_loss_std']:.3f}" if t["seeds"] > 1 else ""
        lines.append(
            f"| {t['run']} | {t['final_eval_loss']:.3f}{spread} | {t['best_eval_loss']:.3f} | "
            f"{t['tokens']:,} | {t['bytes_per_replica']:.3g} | {t['bytes_vs_ddp']:.3g} | "
            f"{wallclock_cell(t)} | {t['utilization']:.2f} |"
        )
    return "\n".join(lines) + wallclock_note(table).rstrip("\n")


def mean_curves(dones: list[dict], groups: dict[str, str],
                metric: str = "eval_loss") -> dict[str, dict]:  # fmt: skip
    """Per group: ``metric`` of each evaluation, its mean over seeds (``loss``) and their
    min-max band (``low``, ``high``), against tokens and steps."""
    by_group = defaultdict(list)
    for done in dones:
        by_group[groups[done["name"]]].append(done["evals"])
    curves = {}
    for group, runs in by_group.items():
        n = min(len(r) for r in runs)
        values = np.array([[e[metric] for e in r[:n]] for r in runs])
        curves[group] = {
            "tokens": [e["tokens"] for e in runs[0][:n]],
            "steps": [e["step"] for e in runs[0][:n]],
            "loss": values.mean(axis=0).tolist(),
            "low": values.min(axis=0).tolist(),
            "high": values.max(axis=0).tolist(),
            "seeds": len(runs),
        }
    return curves


def plotted_metric(base: config_lib.Config, dones: list[dict]) -> str:
    """``sim.plot_metric`` where every evaluation holds it; else ``eval_loss``, with a warning
    naming what the evaluation holds."""
    metric = base.sim.plot_metric
    if all(metric in e for d in dones for e in d["evals"]):
        return metric
    held = sorted({k for d in dones for e in d["evals"] for k in e if k not in BOOKKEEPING})
    log.warning("sim.plot_metric = %r is not in every evaluation (%s): plotting eval_loss",
                metric, ", ".join(held))  # fmt: skip
    return "eval_loss"


def _serve(base: config_lib.Config, workdir: pathlib.Path, names: list[str]):
    """With ``serve.port``: the sweep's server, started (every run shows itself through it,
    and ``/status`` adds the sweep's runs and table so far); else None."""
    from diloco_jax.run.live import bind
    from diloco_jax.watch import serve

    if not base.serve.port:
        return None
    board = serve.Board(
        config=config_lib.to_dict(base),
        total_steps=base.train.total_steps,
        replicas=base.parallel.replicas,
        unit="token",
        tokens_per_step=1,
    )
    token, generated = serve.resolve_token(base.serve.token_file, workdir)
    server = bind(base, board, serve.Controls(), token)
    server.sweep = serve.SweepBoard(names)
    server.start()
    told = f"; control token in {workdir / 'serve_token'}" if generated else ""
    print(f"serving the sweep at http://{base.serve.host}:{server.port}/{told}", file=sys.stderr)
    return server


def _diagnostics(workdir: pathlib.Path, runs) -> list[str]:
    """The sweep's drift.png and cosine.png: a line per group, its first seed's mean over
    replicas (each run drew its own, a line per replica: ``train``)."""
    first: dict[str, list] = {}
    for name, group, _ in runs:
        first.setdefault(group, figures.sync_events(_rundir(workdir, name) / "metrics.jsonl"))
    return figures.diagnostics(first, workdir, per_replica=False)


def _rundir(workdir: pathlib.Path, name: str) -> pathlib.Path:
    return workdir / "runs" / name.replace("/", "_")


def _run_all(runs, workdir: pathlib.Path, params, server, show_progress: bool, task=None,
             given=None):  # fmt: skip
    """Each run of the plan in turn (reusing finished ones): ``(rows, dones, groups)``, or None
    if a signal (or ``POST /control/stop``) stopped one."""
    from diloco_jax.base.progress import progress_bar

    rows, dones, groups = [], [], {}
    bar = progress_bar(len(runs), enabled=show_progress, unit="run")
    for name, group, cfg in runs:
        bar.set_postfix_str(name)
        if server is not None:
            server.sweep.started(name)
        done = run_one(name, cfg, _rundir(workdir, name), server, task, given)
        if done is None:
            bar.close()
            log.warning("sweep stopped during run %s; run the same command to continue", name)
            return None
        groups[name] = group
        dones.append(done)
        rows.append(account(done, cfg, params))
        if server is not None:
            server.sweep.finished(name, rows[-1])
        bar.update(1)
    bar.close()
    return rows, dones, groups


def sweep(base, workdir: pathlib.Path, *, sweeps, baselines, seeds, show_progress=True,
          task=None, inner=None, outer=None) -> list:  # fmt: skip
    """Runs the plan, writes results.csv, summary.csv and, with matplotlib (the plots extra;
    without it a note says so and the tables are still written), curves.png, tradeoff.png and
    the sync diagnostics drift.png and cosine.png (also in each run's directory); returns the
    summary table (a row per group: mean and spread over seeds). ``task``: a user's ArrayTask or
    GrainTask trained by every run (else each config's own); ``inner``, ``outer``: the user's
    own optax transforms (else each config's)."""
    from diloco_jax.config import problems, user_optimizers
    from diloco_jax.watch.reporting import setup_logging

    runs = plan(base, sweeps, baselines, seeds)
    for cfg in {c.data: c for c in (base, *(c for _, _, c in runs))}.values():  # data loaded
        problems.check_extras(cfg)
    draw = not extras.missing("matplotlib")
    if not draw:  # a sweep is worth its tables alone: say so at the start, not after hours
        print(f"note: the figures (curves, tradeoff, drift, cosine) are not drawn (they need "
              f"matplotlib): {extras.install_hint('matplotlib')}", file=sys.stderr)  # fmt: skip
    setup_logging(logging.WARNING)  # the sweep's bar and table say enough
    # the model's shapes give the bytes: the data decide the model (its vocabulary or classes)
    params = problems.load(base, replicas=1, task=task).params
    given = user_optimizers.Given(inner, outer)  # recorded in each run's config: a reused run
    runs = [(n, g, user_optimizers.recorded(c, given, params)) for n, g, c in runs]  # had them
    workdir.mkdir(parents=True, exist_ok=True)
    server = _serve(base, workdir, [name for name, _, _ in runs])
    try:
        done_runs = _run_all(runs, workdir, params, server, show_progress, task, given)
    finally:
        if server is not None:
            server.stop()
    if done_runs is None:
        return []
    rows, dones, groups = done_runs
    write_csv(workdir / "results.csv", rows)
    table = summarize(rows, groups)
    write_csv(workdir / "summary.csv", table)
    written = ["results.csv", "summary.csv"]
    if draw:
        units = dict(unit=dones[0]["unit"], nats=dones[0]["unigram_entropy"] is not None,
                     label=base.sim.plot_label)  # fmt: skip
        metric = plotted_metric(base, dones)
        plots.curves(mean_curves(dones, groups, metric), workdir / "curves.png", metric=metric,
                     **units)  # fmt: skip
        plots.tradeoff(table, workdir / "tradeoff.png", metric=metric, **units)
        written += ["curves.png", "tradeoff.png", *_diagnostics(workdir, runs)]
    log.warning("wrote %s", ", ".join(str(workdir / f) for f in written))
    return table
