"""Benchmark of the whole command, not only its steady state: ``python -m diloco_jax.train`` on
the standard workload, timed from the shell's point of view, with a cold and a warm compilation
cache, and where the time went according to the run's own ``metrics.jsonl`` (its ``done`` event's
``phases``: start, compile, steps, evaluations, checkpoints, finish).

    uv run python scripts/bench_command.py [--replicas 4,8] [--steps 300] [--repeats 1]
                                           [--set KEY=VALUE ...]

Standard workload (bench_sim.py's): 2-layer Transformer, d_model 128, 4 heads, byte vocabulary,
sequence 64, batch 8 per replica, inner AdamW, outer Nesterov, sync_every 10, the default
evaluation (every 100 steps and at the end), the final checkpoint, no text sample. Each command
runs in a child process from a temporary directory, the CPU split as by default. "Cold": a fresh
cache directory; "warm": the same command again with that cache. The ratio against the steps'
own time is the issue-28 target (warm, R=4: at most 1.3).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

WORKLOAD = {
    "model.d_model": 128, "model.num_layers": 2, "model.num_heads": 4, "data.seq_len": 64,
    "data.batch_size": 8, "outer.sync_every": 10, "train.log_every": 10,
    "train.sample_chars": 0, "log.progress_bar": "false",
}  # fmt: skip
PHASES = ("start", "compile", "steps", "eval", "checkpoint", "finish")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def command(replicas: int, steps: int, cache: str, workdir: str, extra: dict) -> dict:
    """One run of the command: its wall time and its own phases."""
    overrides = {**WORKLOAD, "parallel.replicas": replicas, "train.total_steps": steps,
                 "train.compile_cache": cache, **extra}  # fmt: skip
    cmd = [sys.executable, "-m", "diloco_jax.train", "--config", "default", "--workdir",
           f"{workdir}/run", *(f"--config.{k}={v}" for k, v in overrides.items())]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_COMPILE_CACHE"}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    events = [json.loads(line) for line in open(f"{workdir}/run/metrics.jsonl")]
    phases = next(e for e in events if e["event"] == "done")["phases"]
    return {"seconds": seconds, **phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="4,8")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell (the median)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another config override, e.g. log.figures=false (repeatable)",
    )
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.set)
    print(f"{cpu_name()}, {os.cpu_count()} cores; python {platform.python_version()}; "
          f"{args.steps} steps, the standard workload {extra or ''}\n")  # fmt: skip
    print("| R | cache | command (s) | " + " | ".join(f"{p} (s)" for p in PHASES)
          + " | command / steps |")  # fmt: skip
    print("|---:|---|---:|" + "---:|" * len(PHASES) + "---:|")
    for replicas in (int(r) for r in args.replicas.split(",") if r):
        rows: dict[str, list[dict]] = {"cold": [], "warm": []}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                for kind in ("cold", "warm"):  # warm: the same cache, a fresh workdir
                    with tempfile.TemporaryDirectory(dir=tmp) as workdir:
                        rows[kind].append(command(replicas, args.steps, f"{tmp}/cache",
                                                  workdir, extra))  # fmt: skip
        for kind, runs in rows.items():
            med = {k: float(np.median([r[k] or 0.0 for r in runs])) for k in runs[0]}
            cells = " | ".join(f"{med[p]:.1f}" for p in PHASES)
            print(f"| {replicas} | {kind} | {med['seconds']:.1f} | {cells} | "
                  f"{med['seconds'] / med['steps']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
