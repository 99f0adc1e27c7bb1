"""Benchmark: bytes per sync and per token of each way DiLoCo sends less (pseudo-gradient codecs,
Streaming DiLoCo fragments, overlapped outer steps, DCT momentum) against ddp in float32, for the
default model and a ~1B-parameter one (computed from shapes), and the time to encode and decode
the default model's pseudo-gradient against one inner step.

    uv run python scripts/bench_communication.py [--replicas 4] [--sync_every 50] [--repeats 20]

Bytes are what one replica sends (ring all-reduce, or all-gather for top-k and DCT momentum;
``diloco_jax.simulated.comms.sync_payloads``) with the config defaults (block 256, top-k 1%, DCT
chunk 64 with 4 of 64 coefficients, leaves under 4096 values in float32). *Peak* is the largest
single sync (streaming syncs one fragment at a time); *per round* is what ``sync_every`` inner steps
send. Per token: over one round of R replicas at the default batch (16 x 128 tokens); ddp reduces
float32 gradients every step. Delayed and eager outer steps send what plain DiLoCo sends but hide it
behind a round of compute. Timing: encode + decode of the whole flattened pseudo-gradient under
``jit`` (median of ``--repeats``) against the default preset's vmapped inner step divided by R.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from diloco_jax.algorithm import compress, dct  # noqa: E402
from diloco_jax.algorithm.compress import Codec  # noqa: E402
from diloco_jax.algorithm.dct import DctConfig  # noqa: E402
from diloco_jax.data import VOCAB_SIZE  # noqa: E402
from diloco_jax.simulated import comms  # noqa: E402
from diloco_jax.tasks import model as model_lib  # noqa: E402

BIG = {"d_model": 2048, "num_layers": 20, "num_heads": 16, "mlp_ratio": 4}  # ~1.0 B parameters
DEFAULT = {"d_model": 128, "num_layers": 2, "num_heads": 4, "mlp_ratio": 4}
CODECS = [Codec(name) for name in compress.CODECS]
DCT = DctConfig()


def shapes(model: dict):
    return jax.eval_shape(
        lambda: model_lib.init_model(0, vocab_size=VOCAB_SIZE, seq_len=128, **model)[1]
    )


def options(model: dict, sync_every: int):
    """(label, codec, dct config, fragments) of every option worth a row for ``model``."""
    rows = [(c.name, c, None, 1) for c in CODECS]
    rows.append((f"dct momentum (k={DCT.topk}/{DCT.chunk})", None, DCT, 1))
    for f in (2, 5, 10):
        if f <= model["num_layers"] and sync_every % f == 0:
            rows.append((f"streaming F={f}", None, None, f))
            rows.append((f"streaming F={f} + int4", Codec("int4"), None, f))
    return rows


def bytes_table(replicas: int, sync_every: int) -> list[str]:
    tokens_per_round = replicas * 16 * 128 * sync_every
    lines = ["| model | option | peak bytes per sync | bytes per round | vs fp32 DiLoCo "
             "| vs ddp | bytes per token |", "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label, model in (("default", DEFAULT), ("1B: d 2048, 20 layers", BIG)):
        tree = shapes(model)
        size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
        fp32 = comms.bytes_per_replica(comms.sync_payload(tree, None, replicas), replicas)
        ddp_round = sync_every * fp32
        for name, codec, dct_config, fragments in options(model, sync_every):
            payloads = comms.sync_payloads(tree, codec, replicas, dct_config=dct_config,
                                           num_fragments=fragments)  # fmt: skip
            sent = [comms.bytes_per_replica(p, replicas) for p in payloads]
            per_round = sum(sent)  # every fragment syncs once per round
            # per token only at the batch this model trains with here (the default preset's)
            per_token = (
                f"{per_round * replicas / tokens_per_round:.3f}" if model is DEFAULT else "-"
            )
            lines.append(
                f"| {label} ({size / 1e6:,.2f} M values) | {name} | {max(sent):,.0f} | "
                f"{per_round:,.0f} | {per_round / fp32:.3f} | {per_round / ddp_round:.5f} | "
                f"{per_token} |"
            )
    return lines


def timing(replicas: int, repeats: int) -> list[str]:
    from diloco_jax.config import apply_overrides, load_preset
    from diloco_jax.run.setup import build, chunk_control

    cfg = apply_overrides(load_preset("configs/default.py"), [("parallel.runtime", "sim")])
    s = build(cfg)
    control = chunk_control(cfg, s, 0)
    run = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
    state, out = run(s.state, s.replicas_R, s.shards_RxS, control)
    jax.block_until_ready(out)
    tick = time.perf_counter()
    state, out = run(state, s.replicas_R, s.shards_RxS, control)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - tick) / cfg.train.log_every / replicas
    size = s.num_params
    flat = jax.random.normal(jax.random.key(0), (size,)) * 1e-2
    lines = [
        f"\none replica's inner step (default preset, vmapped step / R): {step_s * 1e3:.1f} ms",
        "", "| codec | encode + decode (ms) | vs one inner step |", "|---|---:|---:|",
    ]  # fmt: skip
    for codec in CODECS[1:]:
        if codec.name == "topk":
            k = compress.topk_count(size, codec.topk_fraction)
            fn = jax.jit(
                lambda x, k=k: jnp.zeros_like(x).at[jax.lax.top_k(jnp.abs(x), k)[1]].set(1)
            )
            arg = flat
        else:
            padded = compress.padded_size(size, 1, codec.block)
            arg = jnp.pad(flat, (0, padded - size)).reshape(-1, codec.block)
            fn = jax.jit(lambda x, name=codec.name: compress.roundtrip(x, name))
        ms = _median_ms(fn, arg, repeats)
        lines.append(f"| {codec.name} | {ms:.2f} | {ms / 1e3 / step_s:.3f} |")
    padded = dct.padded(size, DCT.chunk)
    arg = jnp.pad(flat, (0, padded - size))
    fn = jax.jit(lambda x: dct.decode(dct.extract(x, DCT)[0], DCT))
    ms = _median_ms(fn, arg, repeats)
    lines.append(
        f"| dct momentum (k={DCT.topk}/{DCT.chunk}) | {ms:.2f} | {ms / 1e3 / step_s:.3f} |"
    )
    return lines


def _median_ms(fn, arg, repeats: int) -> float:
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - tick)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sync_every", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"R={args.replicas}, sync_every={args.sync_every}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"jax {jax.__version__}\n")  # fmt: skip
    print("\n".join(bytes_table(args.replicas, args.sync_every)))
    print("\n".join(timing(args.replicas, args.repeats)))


if __name__ == "__main__":
    main()
