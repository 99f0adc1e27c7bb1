"""Streamed against loaded training data: the cost of reading each call's batches from disk.

    uv run python scripts/bench_stream.py [--replicas 4] [--calls 5] [--rounds 2]

The corpus is the shipped Shakespeare, written uncompressed to a temporary file (5.4 MB).
``data.max_memory_mib=1`` makes it streamed (memory-mapped, ``diloco_jax/data/stream.py``); 0
loads it. For each, on the default preset's model and batch, the script times:

* the host's reading of one call's batches, ``[N, R, B, L + 1]`` tokens (N = train.log_every),
  in batches per second (one batch = one replica's B windows at one step);
* whole train calls (the data argument made, the compiled call run to its result), in tokens
  per second, the two kinds of call alternating so machine noise hits both.

Medians over ``--calls`` calls in each of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import lzma
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco_jax.config import apply_overrides, load_preset  # noqa: E402
from diloco_jax.train import build, chunk_control  # noqa: E402


def setups(text: pathlib.Path, replicas: int):
    out = {}
    for name, budget in (("loaded", 0), ("streamed", 1)):
        overrides = {"data.corpus": str(text), "data.max_memory_mib": budget,
                     "parallel.replicas": replicas, "parallel.runtime": "sim"}  # fmt: skip
        cfg = apply_overrides(load_preset(str(ROOT / "configs/default.py")),
                              [(k, str(v)) for k, v in overrides.items()])  # fmt: skip
        s = build(cfg)
        control = chunk_control(cfg, s, 0)
        compiled = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
        out[name] = [cfg, s, compiled, control, s.state]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = pathlib.Path(tmp) / "shakespeare.txt"
        with lzma.open(ROOT / "diloco_jax/data/shakespeare.txt.xz") as f:
            text.write_bytes(f.read())
        runs = setups(text, args.replicas)
        cfg, s = runs["streamed"][0], runs["streamed"][1]
        n, r = cfg.train.log_every, args.replicas
        tokens = n * r * cfg.data.batch_size * cfg.data.seq_len
        read, calls = [], {"loaded": [], "streamed": []}
        for _ in range(args.rounds):
            for i in range(args.calls):
                tick = time.perf_counter()
                s.stream.batches(i * n, range(r))
                read.append(time.perf_counter() - tick)
            for i in range(args.calls):
                for name, run in runs.items():
                    _, setup, compiled, control, state = run
                    tick = time.perf_counter()
                    state, metrics = compiled(state, setup.replicas_R, setup.data(i * n), control)
                    jax.block_until_ready(metrics)
                    calls[name].append(time.perf_counter() - tick)
                    run[4] = state
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}; default preset, R={r}, "
        f"{n} steps per call, batch {cfg.data.batch_size} x {cfg.data.seq_len + 1} tokens\n"
    )
    read_s = float(np.median(read))
    print(
        f"host read of one call's batches: {1e3 * read_s:.2f} ms, "
        f"{n * r / read_s:,.0f} batches/s, {tokens / read_s / 1e6:.1f} M tokens/s\n"
    )
    print("| data | ms per call | tokens/s | vs loaded |")
    print("|---|---:|---:|---:|")
    base = float(np.median(calls["loaded"]))
    for name, seconds in calls.items():
        med = float(np.median(seconds))
        print(f"| {name} | {1e3 * med:.1f} | {tokens / med:,.0f} | {base / med:.3f} |")


if __name__ == "__main__":
    main()
