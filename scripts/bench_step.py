"""Benchmark: tokens/s and memory of the default model's train step, three ways.

    uv run python scripts/bench_step.py [--preset configs/default.py] [--calls 4]

* ``one model, batch R*B``: a single model (algorithm ``single``) at the global batch;
* ``R vmapped replicas, batch B``: the simulator (DiLoCo, ``parallel.runtime=sim``);
* ``shard_map, R fake devices``: the mesh runtime, one replica per (fake CPU) device.

Each mode runs in its own process (the fake-device count is fixed at JAX start-up). Throughput
is timed over ``--calls`` compiled calls of ``train.log_every`` steps after one warm-up call.
Memory: XLA's compiled memory analysis of one call (arguments + outputs + temporaries, minus
aliased donations) and the process's peak resident set size. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

MODES = {
    "big": "one model, batch R*B",
    "vmap": "R vmapped replicas, batch B",
    "mesh": "shard_map, R fake devices",
}


def measure(mode: str, preset: str, calls: int) -> dict:
    import jax

    from diloco_jax.config import apply_overrides, load_preset
    from diloco_jax.run.setup import build, chunk_control

    cfg = load_preset(preset)
    replicas, batch = cfg.parallel.replicas, cfg.data.batch_size
    overrides = {
        "big": {"algorithm": "single", "data.batch_size": replicas * batch,
                "parallel.runtime": "sim"},
        "vmap": {"parallel.runtime": "sim"},
        "mesh": {"parallel.runtime": "mesh", "parallel.replica_devices": replicas,
                 "parallel.data_devices": 1},
    }[mode]  # fmt: skip
    cfg = apply_overrides(cfg, [(k, str(v)) for k, v in overrides.items()])
    s = build(cfg)
    control = chunk_control(cfg, s, 0)
    compiled = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
    mem = compiled.memory_analysis()
    state, loss = compiled(s.state, s.replicas_R, s.shards_RxS, control)  # warm-up
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(calls):
        state, loss = compiled(state, s.replicas_R, s.shards_RxS, control)
    jax.block_until_ready(loss)
    seconds = time.perf_counter() - start
    steps = calls * cfg.train.log_every
    tokens = steps * s.layout.replicas * cfg.data.batch_size * cfg.data.seq_len
    xla_bytes = None
    if mem is not None:
        xla_bytes = (
            mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes
        )  # fmt: skip
    return {
        "mode": mode,
        "tokens_per_s": tokens / seconds,
        "step_ms": 1000 * seconds / steps,
        "xla_mib": None if xla_bytes is None else xla_bytes / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "devices": jax.device_count(),
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="configs/default.py")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.preset, args.calls)))
        return
    from diloco_jax.config import load_preset

    replicas = load_preset(args.preset).parallel.replicas
    rows = []
    for mode in MODES:
        env = dict(os.environ)
        if mode == "mesh":
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={replicas}"
        cmd = [sys.executable, __file__, "--mode", mode, "--preset", args.preset,
               "--calls", str(args.calls)]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]["tokens_per_s"]
    cpu = cpu_name()
    import jax

    print(f"preset {args.preset}, R={replicas}; {os.cpu_count()} CPUs ({cpu}), "
          f"python {platform.python_version()}, jax {jax.__version__}")  # fmt: skip
    print("\n| mode | tokens/s | vs one model | ms/step | XLA memory (MiB) | peak RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        xla = "n/a" if row["xla_mib"] is None else f"{row['xla_mib']:.1f}"
        print(f"| {MODES[row['mode']]} | {row['tokens_per_s']:,.0f} | "
              f"{row['tokens_per_s'] / base:.2f} | {row['step_ms']:.1f} | {xla} | "
              f"{row['peak_rss_mib']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
