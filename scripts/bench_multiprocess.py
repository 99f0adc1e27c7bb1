"""Benchmark: one process with 2 devices against 2 processes with 1 device each (same work), and
the cost of a checkpoint save against an outer round.

    uv run python scripts/bench_multiprocess.py [--preset configs/default.py] [--rounds 4]
        [--sync_every 20] [--saves 3]

Both layouts run the preset's DiLoCo job on a ``(replica=2, data=1)`` mesh of CPU devices, so
the compiled per-device program is the same; the two-process run moves the replica all-reduce
through gloo over localhost instead of memory. A call is one outer round (``train.log_every =
outer.sync_every``), timed as the median of ``--rounds`` calls after a warm-up call. Then
``--saves`` checkpoints of the whole train state: the blocking part (``save(wait=False)``
returning) and the total (until ``wait_until_finished``). Prints a Markdown table.
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

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(preset: str, rounds: int, sync_every: int, saves: int, out: str) -> None:
    """One process of a measured run (started by :func:`main` with the launcher's environment)."""
    from diloco_jax.run import distributed

    distributed.initialize(distributed.Cluster())
    import jax
    import numpy as np

    from diloco_jax.config import apply_overrides, load_preset, to_dict
    from diloco_jax.run.setup import build, chunk_control
    from diloco_jax.runtime import checkpoint

    over = {"parallel.runtime": "mesh", "parallel.replica_devices": 2, "parallel.data_devices": 1,
            "outer.sync_every": sync_every, "train.log_every": sync_every}  # fmt: skip
    cfg = apply_overrides(load_preset(preset), [(k, str(v)) for k, v in over.items()])
    s = build(cfg)
    control = chunk_control(cfg, s, 0)
    run = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
    state = s.state
    times = []
    for _ in range(rounds + 1):
        tick = time.perf_counter()
        state, metrics = run(state, s.replicas_R, s.shards_RxS, control)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - tick)
    blocking, total = [], []
    mngr = checkpoint.manager(pathlib.Path(os.environ["BENCH_TMP"]), max_to_keep=2)  # shared dir
    for i in range(saves + 1):
        tick = time.perf_counter()
        checkpoint.save(mngr, i + 1, state, to_dict(cfg), wait=False)
        blocking.append(time.perf_counter() - tick)
        mngr.wait_until_finished()
        total.append(time.perf_counter() - tick)
    mngr.close()
    if jax.process_index() == 0:
        result = {
            "round_s": float(np.median(times[1:])),
            "save_blocking_s": float(np.median(blocking[1:])),
            "save_total_s": float(np.median(total[1:])),
            "state_mib": sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20,
            "processes": jax.process_count(),
        }
        pathlib.Path(out).write_text(json.dumps(result))


def measure(processes: int, devices: int, args) -> dict:
    from diloco_jax.launch import child_env, free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", "--preset", args.preset, "--rounds",
               str(args.rounds), "--sync_every", str(args.sync_every), "--saves",
               str(args.saves), "--out", str(out)]  # fmt: skip
        procs = [subprocess.Popen(cmd, cwd=ROOT, env={**child_env(i, processes, port, devices),
                                                      "BENCH_TMP": tmp})
                 for i in range(processes)]  # fmt: skip
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"worker failed with status {codes}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="configs/default.py")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sync_every", type=int, default=20)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.preset, args.rounds, args.sync_every, args.saves, args.out)
        return
    rows = {"1 process x 2 devices": measure(1, 2, args),
            "2 processes x 1 device": measure(2, 1, args)}  # fmt: skip
    base = rows["1 process x 2 devices"]["round_s"]
    print(f"\n{args.preset}, R=4 on (replica=2, data=1), sync_every={args.sync_every}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")  # fmt: skip
    print(
        "| layout | s per outer round | vs 1 process | checkpoint blocking (s) | "
        "checkpoint total (s) | total / round | state MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['round_s']:.3f} | {r['round_s'] / base:.2f} | "
              f"{r['save_blocking_s']:.3f} | {r['save_total_s']:.3f} | "
              f"{r['save_total_s'] / r['round_s']:.3f} | {r['state_mib']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
