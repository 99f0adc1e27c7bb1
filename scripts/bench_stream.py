"""Streamed against loaded training data: the cost of reading each call's batches from disk.

    uv run python scripts/bench_stream.py [--images] [--replicas 4] [--calls 5] [--rounds 2]

Text (default): the shipped Shakespeare, written uncompressed to a temporary file (5.4 MB), on
the default preset's model and batch. ``--images``: the shipped digits as PNG files, prepared
as a TFDS dataset and resized to 32x32 (1,437 training images, 1.4 MiB as uint8), on the digits
preset's ResNet and batch. ``data.max_memory_mib=1`` (text) or ``0.5`` (images) makes the
training split streamed (memory-mapped, ``diloco_jax/data/stream.py``); 0 loads it. For each,
the script times:

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
from diloco_jax.run.setup import build, chunk_control  # noqa: E402


def _images(tmp: pathlib.Path) -> dict:
    """The digits as a 32x32 TFDS image dataset in ``tmp``: the run's data overrides."""
    from diloco_jax.data import tfds_images
    from scripts.digits_folder import main as digits_folder

    digits_folder(str(tmp / "pngs"))
    tfds_images.prepare(tmp / "pngs", tmp / "tfds", name="digits32", val_fraction=0.2, size=32)
    return {"data.corpus": "tfds:digits32", "data.data_dir": str(tmp / "tfds"),
            "data.image_size": 32}  # fmt: skip


def _text(tmp: pathlib.Path) -> dict:
    text = tmp / "shakespeare.txt"
    with lzma.open(ROOT / "diloco_jax/data/shakespeare.txt.xz") as f:
        text.write_bytes(f.read())
    return {"data.corpus": str(text)}


def setups(data: dict, replicas: int, images: bool):
    out = {}
    preset = "configs/digits.py" if images else "configs/default.py"
    for name, budget in (("loaded", 0), ("streamed", 0.5 if images else 1)):
        overrides = {**data, "data.max_memory_mib": budget, "parallel.replicas": replicas,
                     "parallel.runtime": "sim"}  # fmt: skip
        cfg = apply_overrides(load_preset(str(ROOT / preset)),
                              [(k, str(v)) for k, v in overrides.items()])  # fmt: skip
        s = build(cfg)
        control = chunk_control(cfg, s, 0)
        compiled = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
        out[name] = [cfg, s, compiled, control, s.state]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", action="store_true", help="a TFDS image dataset")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = (_images if args.images else _text)(pathlib.Path(tmp))
        runs = setups(data, args.replicas, args.images)
        cfg, s = runs["streamed"][0], runs["streamed"][1]
        assert s.stream is not None and runs["loaded"][1].stream is None
        n, r = cfg.train.log_every, args.replicas
        tokens = n * r * cfg.data.batch_size * s.tokens_per_row
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
    preset = "digits" if args.images else "default"
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {preset} preset, R={r}, "
        f"{n} steps per call, batch {cfg.data.batch_size} x {s.tokens_per_row} {s.unit}s\n"
    )
    read_s = float(np.median(read))
    print(
        f"host read of one call's batches: {1e3 * read_s:.2f} ms, "
        f"{n * r / read_s:,.0f} batches/s, {tokens / read_s / 1e6:.3f} M {s.unit}s/s\n"
    )
    print(f"| data | ms per call | {s.unit}s/s | vs loaded |")
    print("|---|---:|---:|---:|")
    base = float(np.median(calls["loaded"]))
    for name, seconds in calls.items():
        med = float(np.median(seconds))
        print(f"| {name} | {1e3 * med:.1f} | {tokens / med:,.0f} | {base / med:.3f} |")


if __name__ == "__main__":
    main()
