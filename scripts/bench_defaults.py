"""Benchmark of what the defaults cost a user: the periodic checkpoints of a default run, and
a dry run's time and memory.

    uv run python scripts/bench_defaults.py checkpoints [--steps 1000] [--minutes 0,2,1e-9]
    uv run python scripts/bench_defaults.py dry_run [--presets lm_1b]

``checkpoints``: the default preset (``python -m diloco_jax.train``, as the README's quickstart,
without the text sample or a compilation cache) once per ``train.checkpoint_minutes`` value,
in turn: 0 (a save at the end only), the default 2, and 1e-9 (a save at every sync, the most
there can be); for each, the command's wall time, its own phases (``metrics.jsonl``'s ``done``
event: steps, checkpoint), the saves made, and the wall time over the first value's.

``dry_run``: ``--dry_run`` of each preset with a cold compilation cache: wall time and the
child's peak resident memory (``getrusage``'s ``ru_maxrss``), the exit status (2: it does not
fit this machine, which is the answer a dry run gives) and the hint line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from bench_command import cpu_name  # scripts/ is sys.path[0] when a script runs


def _child(cmd: list[str], cwd: str) -> tuple[float, int, str, int]:
    """Runs ``cmd``; its wall seconds, exit status, stderr and peak RSS in bytes. Each child
    runs after the last one ended, so RUSAGE_CHILDREN's maximum grows only with a larger one:
    the children are run in increasing expected size, and a smaller one's reads as at most."""
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_COMPILE_CACHE"}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return seconds, done.returncode, done.stderr, peak


def checkpoints(steps: int, minutes: list[str]) -> None:
    print(f"{cpu_name()}, {os.cpu_count()} cores; the default preset, {steps} steps\n")
    print("| train.checkpoint_minutes | command (s) | steps (s) | checkpoint (s) | saves | "
          "command / first |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    first = None
    for value in minutes:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "diloco_jax.train", "--workdir", f"{tmp}/run",
                   f"--config.train.total_steps={steps}", "--config.train.sample_chars=0",
                   "--config.log.progress_bar=false", "--config.train.compile_cache=off",
                   f"--config.train.checkpoint_minutes={value}",
                   "--config.train.keep_checkpoints=1000"]  # fmt: skip
            seconds, code, err, _ = _child(cmd, tmp)
            if code:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
            events = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
            phases = next(e for e in events if e["event"] == "done")["phases"]
            saves = len(os.listdir(f"{tmp}/run/checkpoints"))
        first = first or seconds
        print(f"| {value} | {seconds:.1f} | {phases['steps']:.1f} | {phases['checkpoint']:.2f} | "
              f"{saves} | {seconds / first:.3f} |")  # fmt: skip


def dry_run(presets: list[str]) -> None:
    print(f"{cpu_name()}, {os.cpu_count()} cores; --dry_run, a cold compilation cache\n")
    print("| preset | wall (s) | peak RSS (GiB) | exit | last line |")
    print("|---|---:|---:|---:|---|")
    for preset in presets:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "diloco_jax.train", "--config", preset, "--dry_run",
                   f"--config.train.compile_cache={tmp}/c"]  # fmt: skip
            seconds, code, err, peak = _child(cmd, tmp)
        last = (err.strip().splitlines() or [""])[-1].replace("|", "/")
        print(f"| {preset} | {seconds:.1f} | {peak / 2**30:.2f} | {code} | {last} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    ck = sub.add_parser("checkpoints")
    ck.add_argument("--steps", type=int, default=1000)
    ck.add_argument("--minutes", default="0,2,1e-9")
    dr = sub.add_parser("dry_run")
    dr.add_argument("--presets", default="lm_1b")
    args = parser.parse_args()
    if args.what == "checkpoints":
        checkpoints(args.steps, args.minutes.split(","))
    else:
        dry_run(args.presets.split(","))


if __name__ == "__main__":
    main()
