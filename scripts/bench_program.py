"""Benchmark of the kept traced step against the step JAX traces itself: the same training call,
compiled both ways in one process, timed call by call in alternation, and the states they reach
compared bit for bit.

    uv run python scripts/bench_program.py [--replicas 4] [--calls 30]

A warm ``python -m diloco_jax.train`` on a CPU runs its step as the call of an exported program
(``runtime/compile_cache.py``: ``export_program``, ``load_program``), not as the jitted step
itself; this measures that the executable is as fast and computes the same. Workload: the
command's (``bench_command.WORKLOAD``: 2-layer Transformer, d_model 128, 4 heads, sequence 64,
batch 8 per replica, sync_every 10, 10 steps per call), the CPU split into devices as the
command splits it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_command import WORKLOAD, cpu_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--calls", type=int, default=30, help="timed calls of each, alternating")
    args = parser.parse_args()

    from diloco_jax.config import apply_overrides, load_preset
    from diloco_jax.run import placement

    overrides = {**WORKLOAD, "parallel.replicas": args.replicas}
    cfg = apply_overrides(load_preset("default"), [(k, str(v)) for k, v in overrides.items()])
    placement.split_cpu(cfg)  # before JAX starts, as the command does

    import jax

    from diloco_jax.run.setup import build, chunk_control
    from diloco_jax.runtime import compile_cache

    s = build(cfg)
    print(f"{cpu_name()}, {os.cpu_count()} cores; python {platform.python_version()}; jax "
          f"{jax.__version__}; R={args.replicas}, {s.layout}, {cfg.train.log_every} steps per "
          f"call\n")  # fmt: skip
    call_args = (s.state, s.replicas_R, s.shards_RxS, chunk_control(cfg, s, 0))
    direct = s.run_chunk.lower(*call_args).compile()
    program = compile_cache.export_program(s.run_chunk, call_args, None).compile()

    states = {"jitted step": s.state, "exported program": jax.tree.map(lambda x: x.copy(), s.state)}
    runs = {"jitted step": direct, "exported program": program}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for call in range(args.calls + 1):  # the first call of each is a warm-up
        control = chunk_control(cfg, s, call * cfg.train.log_every)
        for name, run in runs.items():
            start = time.perf_counter()
            states[name], metrics = run(states[name], s.replicas_R, s.shards_RxS, control)
            jax.block_until_ready((states[name], metrics))
            if call:
                seconds[name].append(time.perf_counter() - start)
    median = {name: float(np.median(v)) for name, v in seconds.items()}
    print("\n| step | median call (s) | min (s) | max (s) |\n|---|---:|---:|---:|")
    for name, v in seconds.items():
        print(f"| {name} | {median[name]:.3f} | {min(v):.3f} | {max(v):.3f} |")
    ratio = median["exported program"] / median["jitted step"]
    a, b = (jax.tree.leaves(jax.device_get(states[n])) for n in runs)
    same = all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    steps = (args.calls + 1) * cfg.train.log_every
    print(f"\nexported / jitted, median call: {ratio:.3f}; the states after {steps} steps "
          f"{'are bitwise equal' if same else 'DIFFER'}")  # fmt: skip


if __name__ == "__main__":
    main()
