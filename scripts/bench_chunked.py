"""The chunked simulator: R virtual replicas run K at a time (``sim.chunk``), against all at once.

    uv run python scripts/bench_chunked.py [--replicas 16] [--chunks 16,8,4] [--calls 2]
        [--rounds 1] [--set KEY=VALUE ...]

The default preset in the simulator (one device), ``train.log_every`` = ``outer.sync_every`` =
25, so each call holds one sync (which the chunked runner takes once over all replicas). Rows:
all at once (``sim.chunk=0``: one vmap of R), each K of ``--chunks``, and the smallest K with the
state in host memory (``sim.offload``). For each: the memory of one compiled call from XLA's
analysis (the chunk's call; temporaries: the larger of the chunk's and the sync's), and whole
calls timed to their result, the rows' calls alternating so machine noise hits all alike.
Medians over ``--calls`` calls in each of ``--rounds`` rounds.
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
from diloco_jax.run import memory  # noqa: E402
from diloco_jax.run.setup import build, chunk_control  # noqa: E402
from scripts.alternate import time_calls  # noqa: E402


def setup(chunk: int, offload: bool, args) -> list:
    overrides = {"parallel.replicas": args.replicas, "parallel.runtime": "sim",
                 "train.log_every": 25, "outer.sync_every": 25, "sim.chunk": chunk,
                 "sim.offload": offload}  # fmt: skip
    items = [(k, str(v)) for k, v in overrides.items()] + [tuple(x.split("=", 1)) for x in args.set]
    cfg = apply_overrides(load_preset(str(ROOT / "configs/default.py")), items)
    s = build(cfg)
    control = chunk_control(cfg, s, 0)
    compiled = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
    return [cfg, s, compiled, control, s.state, compiled.memory_analysis()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--chunks", default="16,8,4")
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE")
    args = parser.parse_args()
    chunks = [int(k) for k in args.chunks.split(",")]
    rows = {"all at once (sim.chunk=0)": (0, False)}
    rows |= {f"K={k}": (k, False) for k in chunks}
    rows[f"K={min(chunks)}, offload"] = (min(chunks), True)
    runs = {name: setup(k, off, args) for name, (k, off) in rows.items()}
    calls = time_calls(runs, calls=args.calls, rounds=args.rounds)
    cfg, s = runs["all at once (sim.chunk=0)"][:2]
    n, r = cfg.train.log_every, args.replicas
    tokens = n * r * cfg.data.batch_size * cfg.data.seq_len
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; default preset {args.set}, "
          f"{s.num_params:,} params, R={r}, {n} steps per call with one sync, "
          f"batch {cfg.data.batch_size} x {cfg.data.seq_len}\n")  # fmt: skip
    print("| run | chunks | XLA temporaries | ms per call | tokens/s | vs all at once | "
          "ms per extra chunk |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = float(np.median(calls["all at once (sim.chunk=0)"]))
    for name, run in runs.items():
        chunk, med = rows[name][0] or r, float(np.median(calls[name]))
        count = r // chunk
        extra = f"{1e3 * (med - base) / (count - 1):.1f}" if count > 1 else ""
        print(f"| {name} | {count} | {memory.size(run[5].temp_size_in_bytes)} | "
              f"{1e3 * med:.1f} | {tokens / med:,.0f} | {base / med:.3f} | {extra} |")  # fmt: skip


if __name__ == "__main__":
    main()
