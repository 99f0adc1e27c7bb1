"""FSDP within a replica against whole replicas: step time and memory per device.

    uv run python scripts/bench_fsdp.py [--replicas 2] [--data_devices 2] [--calls 5]
        [--rounds 2] [--set model.d_model=256 ...]

Both runs use the same mesh (``--replicas`` replica devices x ``--data_devices`` data devices,
the CPU split into that many XLA devices) and the default preset with the ``--set`` overrides;
``parallel.fsdp`` is the only difference. For each the script prints the memory plan's
per-device bytes (XLA's own memory analysis of the compiled call: state, temporaries, total)
and times whole train calls to their result, the two kinds alternating so machine noise hits
both. Medians over ``--calls`` calls in each of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco_jax.config import apply_overrides, load_preset  # noqa: E402
from diloco_jax.run import memory, placement  # noqa: E402
from diloco_jax.run.setup import build, chunk_control  # noqa: E402
from scripts.alternate import time_calls  # noqa: E402


def setup(fsdp: bool, args) -> list:
    overrides = {"parallel.replicas": args.replicas, "parallel.runtime": "mesh",
                 "parallel.replica_devices": args.replicas,
                 "parallel.data_devices": args.data_devices, "parallel.fsdp": fsdp,
                 "parallel.cpu_devices": args.replicas * args.data_devices}  # fmt: skip
    items = [(k, str(v)) for k, v in overrides.items()] + [tuple(x.split("=", 1)) for x in args.set]
    cfg = apply_overrides(load_preset(str(ROOT / "configs/default.py")), items)
    s = build(cfg)
    control = chunk_control(cfg, s, 0)
    compiled = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
    return [cfg, s, compiled, control, s.state, placement.memory_plan(s, compiled)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--data_devices", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE")
    args = parser.parse_args()
    runs = {"whole replicas": setup(False, args), "fsdp": setup(True, args)}
    calls = time_calls(runs, calls=args.calls, rounds=args.rounds)
    cfg, s = runs["fsdp"][0], runs["fsdp"][1]
    n, r = cfg.train.log_every, args.replicas
    tokens = n * r * cfg.data.batch_size * cfg.data.seq_len
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; default preset {args.set}, "
          f"{s.num_params:,} params, {r} replicas x {args.data_devices} data devices, "
          f"{n} steps per call, batch {cfg.data.batch_size} x {cfg.data.seq_len}\n")  # fmt: skip
    print("| layout | state per device | XLA temporaries | total per device | ms per call | "
          "tokens/s | vs whole |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = float(np.median(calls["whole replicas"]))
    for name, run in runs.items():
        plan, med = run[5], float(np.median(calls[name]))
        state = memory.bytes_per_device(run[1].state)
        temps = dict(plan.parts).get("XLA temporaries (activations, gradients)", 0)
        print(f"| {name} | {memory.size(state)} | {memory.size(temps)} | "
              f"{memory.size(plan.total)} | {1e3 * med:.1f} | {tokens / med:,.0f} | "
              f"{base / med:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
