"""Benchmark of a sweep's compiles: ``python -m sim`` over values that are not shapes (the outer
learning rate and the seed, by default 3 x 2 runs) on the standard workload, from a fresh
compilation cache, timed from the shell's point of view; then, from each run's own
``metrics.jsonl`` (its ``done`` event), whether its step was compiled or loaded from the cache
and what its compile phase took.

    uv run python scripts/bench_sweep.py [--replicas 4] [--steps 300]
        [--sweep outer.learning_rate=0.5,0.7,1.0] [--seeds 0,1] [--set KEY=VALUE ...]

The seed and a constant outer learning rate are inputs of the compiled step
(``StepControl.seed``, ``recipe.outer_lr_input``), so the sweep should compile its step once and
load it for every other run. Workload as ``bench_command.py``'s (2-layer Transformer, d_model
128, 4 heads, sequence 64, batch 8 per replica, sync_every 10), with the simulator's own
settings (one device, ``parallel.runtime=sim``) and no figures.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_command import WORKLOAD, cpu_name  # noqa: E402


def sweep(args, extra: dict, tmp: str) -> tuple[float, list[dict]]:
    """One ``python -m sim`` run of the whole sweep: its wall time and a row per run."""
    overrides = {**WORKLOAD, "parallel.replicas": args.replicas,
                 "train.total_steps": args.steps, "train.compile_cache": f"{tmp}/cache",
                 "log.figures": "false", **extra}  # fmt: skip
    cmd = [sys.executable, "-m", "sim", "--config", "default", "--workdir", f"{tmp}/sweep",
           "--seeds", args.seeds, *(f"--sweep={s}" for s in args.sweep),
           *(f"--config.{k}={v}" for k, v in overrides.items())]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_COMPILE_CACHE"}
    env["TQDM_DISABLE"] = "1"
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rows = []
    for metrics in sorted(pathlib.Path(f"{tmp}/sweep/runs").glob("*/metrics.jsonl")):
        events = [json.loads(line) for line in metrics.read_text().splitlines()]
        summary = next(e for e in events if e["event"] == "done")
        rows.append({"run": metrics.parent.name, "from_cache": summary.get("step_from_cache"),
                     **summary["phases"]})  # fmt: skip
    return seconds, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sweep", action="append", default=None, metavar="KEY=V1,V2,...",
                        help="a swept key, as python -m sim takes it (repeatable; default "
                        "outer.learning_rate=0.5,0.7,1.0)")  # fmt: skip
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another config override (repeatable)")  # fmt: skip
    args = parser.parse_args()
    args.sweep = args.sweep or ["outer.learning_rate=0.5,0.7,1.0"]
    extra = dict(item.split("=", 1) for item in args.set)
    print(f"{cpu_name()}, {os.cpu_count()} cores; python {platform.python_version()}; "
          f"R={args.replicas}, {args.steps} steps, sweep {args.sweep}, seeds {args.seeds} "
          f"{extra or ''}\n")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        seconds, rows = sweep(args, extra, tmp)
    print("| run | step | start (s) | compile (s) | steps (s) | eval (s) | finish (s) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        how = {True: "loaded", False: "compiled", None: "?"}[r["from_cache"]]
        print(f"| {r['run']} | {how} | {r['start']:.1f} | {r['compile']:.1f} | "
              f"{r['steps']:.1f} | {r['eval']:.1f} | {r['finish']:.1f} |")  # fmt: skip
    known = all(r["from_cache"] is not None for r in rows)  # older versions did not say
    compiled = sum(r["from_cache"] is False for r in rows) if known else "?"
    compile_s = sum(r["compile"] for r in rows)
    steps_s = sum(r["steps"] for r in rows)
    print(f"\n{len(rows)} runs in {seconds:.1f} s: steps {steps_s:.1f} s, compile phases "
          f"{compile_s:.1f} s, {compiled} step(s) compiled; sweep / steps "
          f"{seconds / steps_s:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
