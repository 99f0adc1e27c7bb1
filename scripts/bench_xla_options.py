"""Does an XLA compiler option pay? The simulator's step compiled with XLA's defaults and with
the options, timed call by call in alternation in one process (so machine noise hits both).

    uv run python scripts/bench_xla_options.py [--replicas 4,8,16] [--calls 8]
        [--option xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT ...]

Standard workload of ``scripts/bench_sim.py`` (sync every 10 steps, 10 steps per call). For each
R it prints ms per inner step both ways, and the cost of one sync both ways: (a call syncing
every step - a call never syncing) / 10. Options are ``DebugOptions`` fields given to
``Lowered.compile(compiler_options=...)``; enum values by their full name.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_sim import config  # noqa: E402  (scripts/ is not a package)

from diloco_jax.run.setup import build, chunk_control  # noqa: E402

DEFAULT_OPTION = "xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"


def alternate(cfg, options: dict, calls: int) -> tuple[float, float]:
    """Seconds per call (medians) of the step compiled without and with ``options``."""
    s = build(cfg)
    control = chunk_control(cfg, s, 0)
    lowered = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control)
    compiled = [lowered.compile(), lowered.compile(compiler_options=options)]
    states = [s.state, jax.tree.map(lambda x: x.copy(), s.state)]  # each call donates its own
    seconds: list[list[float]] = [[], []]
    for i in range(calls + 1):  # the first round warms up
        for k in (0, 1):
            start = time.perf_counter()
            states[k], metrics = compiled[k](states[k], s.replicas_R, s.shards_RxS, control)
            jax.block_until_ready(metrics)
            if i:
                seconds[k].append(time.perf_counter() - start)
    return float(np.median(seconds[0])), float(np.median(seconds[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="4,8,16")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--option", action="append", metavar="KEY=VALUE")
    args = parser.parse_args()
    options = dict(kv.split("=", 1) for kv in (args.option or [DEFAULT_OPTION]))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; options {options}\n")
    print("| R | ms/step, defaults | ms/step, options | options / defaults | ms/sync, defaults | "
          "ms/sync, options |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for r in (int(x) for x in args.replicas.split(",") if x):
        kw = {"parallel.replicas": r}
        step = alternate(config(**kw), options, args.calls)
        every = alternate(config(**kw, **{"outer.sync_every": 1}), options, args.calls)
        never = alternate(config(**kw, **{"outer.sync_every": 1_000_000}), options, args.calls)
        ms = [100 * x for x in step]  # 10 steps per call
        sync = [100 * max(e - n, 0.0) for e, n in zip(every, never, strict=True)]
        print(f"| {r} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[1] / ms[0]:.3f} | {sync[0]:.1f} | "
              f"{sync[1]:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
