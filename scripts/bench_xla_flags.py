"""XLA flags and CPU device counts against each other: ms per inner step of the simulator's
standard workload (``scripts/bench_sim.py``), each setting in its own process (``XLA_FLAGS`` is
read once, when JAX starts), settings interleaved over ``--rounds`` so machine noise hits all.

    uv run python scripts/bench_xla_flags.py [--rounds 3] [--replicas 4] [--flags FLAGS ...]
    uv run python scripts/bench_xla_flags.py --replicas 8,16 --devices 2

Each child times R vmapped replicas (batch 8 each) and one model at batch 8R: the median of 10
compiled calls of 10 steps after a warm-up. With ``--devices K`` a second setting splits the CPU
into K XLA devices and runs the replicas on the mesh runtime (R/K vmapped replicas per device);
the one model stays on one device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_FLAGS = [
    "",
    "--xla_cpu_experimental_ynn_fusion_type=",
    "--xla_cpu_experimental_ynn_fusion_type=individual_dot",
    "--xla_cpu_experimental_ynn_fusion_type=dot",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "--xla_cpu_multi_thread_eigen=false",
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
]


def child(replicas: int, devices: int) -> dict:
    import jax
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_sim import config

    from diloco_jax.run.setup import build, chunk_control

    mesh = {"parallel.runtime": "mesh", "parallel.replica_devices": devices,
            "parallel.data_devices": 1} if devices > 1 else {}  # fmt: skip
    out = {}
    for name, overrides in [
        ("replicas", {"parallel.replicas": replicas, **mesh}),
        ("one_model", {"algorithm": "single", "data.batch_size": 8 * replicas,
                       "parallel.runtime": "sim"}),
    ]:  # fmt: skip
        cfg = config(**overrides)
        s = build(cfg)
        control = chunk_control(cfg, s, 0)
        compiled = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
        state, seconds = s.state, []
        for i in range(11):
            start = time.perf_counter()
            state, metrics = compiled(state, s.replicas_R, s.shards_RxS, control)
            jax.block_until_ready(metrics)
            if i:
                seconds.append(time.perf_counter() - start)
        out[name] = float(np.median(seconds)) * 100  # ms per inner step (10 per call)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", default="4")
    parser.add_argument("--flags", nargs="*", default=None, help="XLA_FLAGS values to compare")
    parser.add_argument("--devices", type=int, default=1, help="also run on K CPU devices")
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    settings = [(f, 1) for f in (DEFAULT_FLAGS if args.flags is None else args.flags)]
    if args.devices > 1:
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        settings = [("", 1), (flag, args.devices)] if args.flags is None else settings
    print("| round | R | XLA_FLAGS | devices | ms/step, replicas | ms/step, one model |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in (int(x) for x in args.replicas.split(",")):
        for round_ in range(1, args.rounds + 1):
            for flags, devices in settings:
                env = {**os.environ, "XLA_FLAGS": flags}
                cmd = [sys.executable, __file__, "--child", str(r), str(devices)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"| {round_} | {r} | `{flags or '(none)'}` | {devices} | "
                      f"{row['replicas']:.1f} | {row['one_model']:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
