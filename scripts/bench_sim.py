"""Benchmark of the simulator: vmapped workers against one big model, outer-step cost, memory, MFU.

    uv run python scripts/bench_sim.py [--replicas 1,4,8,16] [--calls 5]

Standard workload (issue #3): 2-layer Transformer, d_model 128, 4 heads, byte vocabulary,
sequence 64, batch 8 per worker, inner AdamW, outer Nesterov, sync_every 10. For each R:

* tokens/s of R vmapped workers (batch 8 each) and of one model at batch 8R, and their ratio;
* XLA's memory of one compiled call, against ``R x (params + inner state) + anchor + outer
  state`` computed from the state's leaves;
* model FLOP utilization: tokens/s x training FLOPs per token (6 N + 12 layers x seq x d) over
  this machine's fp32 matmul rate, measured in the same run (2048 x 2048 matmul, blocking after
  every call), which is checked against the CPU's theoretical peak (cores x FMA units x SIMD
  lanes x 2 x clock, read from ``/proc/cpuinfo``): a rate above it is reported, and one above
  twice it is called impossible (a measurement bug), not used;
* the outer step's share of a round at sync_every=100 (from a 100-step call that syncs every
  step against one that never syncs);
* the training loop itself, the command a user runs (``python -m diloco_jax.train`` on the same
  workload for 300 steps, 4 and 8 replicas, with the CPU as one XLA device and split by default,
  ``parallel.cpu_devices``): the whole command's time, steady tokens/s from its
  ``metrics.jsonl``, the fraction of the matmul rate, the host work between calls, peak RSS;
  and, for those replica counts, the rate of the workload's own matmuls (d_model 128), a
  nearer ceiling than the 2048x2048 one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.config import apply_overrides, load_preset
from diloco_jax.run.setup import build, chunk_control
from diloco_jax.simulated import comms

WORKLOAD = {
    "model.d_model": 128, "model.num_layers": 2, "model.num_heads": 4, "data.seq_len": 64,
    "data.batch_size": 8, "outer.sync_every": 10, "train.log_every": 10,
    "parallel.runtime": "sim",
}  # fmt: skip


def matmul_flops_per_s(n: int = 2048, repeats: int = 10) -> float:
    """The fp32 rate of an ``n x n`` matmul: the median of ``repeats`` calls, each timed to its
    result (no call overlaps another)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    return 2 * n**3 / median_seconds(jax.jit(lambda x: x @ x), a, repeats=repeats)


def median_seconds(fn, *args, repeats: int = 10) -> float:
    """The median time of ``repeats`` calls of ``fn(*args)`` after a warm-up, each timed to its
    result (no call overlaps another)."""
    jax.block_until_ready(fn(*args))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds))


def workload_matmul_rate(replicas: int, repeats: int = 10) -> float:
    """The fp32 rate of the standard workload's own Linear matmuls, each with its two gradient
    matmuls (dX = dY W^T, dW = X^T dY), batched over ``replicas`` as the vmapped step runs them:
    one replica's 512 tokens (batch 8 x sequence 64) through 2 layers of qkv, out, MLP up and
    down at d_model 128, and the 256-way head. The median of ``repeats`` calls, each timed to
    its result: a ceiling nearer the step's than the 2048x2048 rate."""
    tokens, d = 8 * 64, 128
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * 2 + [(d, 256)]
    keys = iter(jax.random.split(jax.random.key(1), 3 * len(shapes)))
    args = [
        (jax.random.normal(next(keys), (replicas, tokens, i)),
         jax.random.normal(next(keys), (replicas, i, o)),
         jax.random.normal(next(keys), (replicas, tokens, o)))
        for i, o in shapes
    ]  # fmt: skip

    @jax.jit
    def forward_and_grads(args):
        return [
            (jnp.einsum("rti,rio->rto", x, w), jnp.einsum("rto,rio->rti", dy, w),
             jnp.einsum("rti,rto->rio", x, dy))
            for x, w, dy in args
        ]  # fmt: skip

    flops = sum(3 * 2 * replicas * tokens * i * o for i, o in shapes)
    return flops / median_seconds(forward_and_grads, args, repeats=repeats)


def cpu_peak_flops_per_s(fma_units: int = 2, clock_ghz: float | None = None) -> tuple[float, str]:
    """The CPU's theoretical fp32 peak and how it was computed: cores (this process's affinity)
    x ``fma_units`` x SIMD lanes (AVX-512: 16, AVX/AVX2: 8, else 4) x 2 (a fused multiply-add
    is two FLOPs; without FMA, 1) x clock (``cpu MHz`` of ``/proc/cpuinfo``, the nominal clock
    under a hypervisor: turbo can run above it). Linux only; ``(nan, reason)`` elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return float("nan"), "no /proc/cpuinfo"
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                      if ln.startswith("flags")), []))  # fmt: skip
    lanes = 16 if "avx512f" in flags else 8 if "avx" in flags else 4
    per_fma = 2 if "fma" in flags else 1
    if clock_ghz is None:
        mhz = [float(ln.split(":")[1]) for ln in info.splitlines() if ln.startswith("cpu MHz")]
        clock_ghz = max(mhz) / 1e3 if mhz else float("nan")
    cores = len(os.sched_getaffinity(0))
    peak = cores * fma_units * lanes * per_fma * clock_ghz * 1e9
    how = (f"{cores} cores x {fma_units} FMA units x {lanes} fp32 lanes x {per_fma} x "
           f"{clock_ghz:.2f} GHz")  # fmt: skip
    return peak, how


def check_rate(measured: float, peak: float) -> str:
    """A verdict on a measured FLOP rate against the theoretical peak."""
    if not np.isfinite(peak):
        return "theoretical peak unknown on this machine"
    ratio = measured / peak
    if ratio > 2:
        return (f"IMPOSSIBLE: {ratio:.2f}x the theoretical peak; the measurement is wrong and "
                "the utilization figures below are not meaningful")  # fmt: skip
    if ratio > 1:
        return (f"{ratio:.2f}x the peak at the nominal clock: the cores run above it (turbo), "
                "or pass --clock_ghz")  # fmt: skip
    return f"{ratio:.2f} of the theoretical peak"


def timed(s, cfg, calls: int) -> tuple[float, object]:
    """Seconds per compiled call (median of ``calls`` after a warm-up) and the compiled call."""
    control = chunk_control(cfg, s, 0)
    compiled = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
    state, out = compiled(s.state, s.replicas_R, s.shards_RxS, control)
    jax.block_until_ready(out)
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        state, out = compiled(state, s.replicas_R, s.shards_RxS, control)
        jax.block_until_ready(out)
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds)), compiled


def xla_mib(compiled) -> float:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return (total - m.alias_size_in_bytes) / 2**20


def config(**overrides):
    merged = {**WORKLOAD, **overrides}
    return apply_overrides(
        load_preset("configs/default.py"), [(k, str(v)) for k, v in merged.items()]
    )


def flops_per_token(s, cfg) -> float:
    params = jax.tree.map(lambda x: x[0], s.state.params)
    total = sum(x.size for x in jax.tree.leaves(params))
    lookup = params["embed"]["embedding"].size + params["pos_LxD"].size  # gathers, not matmuls
    m = cfg.model
    return 6 * (total - lookup) + 12 * m.num_layers * cfg.data.seq_len * m.d_model


def bench_replicas(replicas: int, calls: int, peak: float) -> dict:
    vm_cfg = config(**{"parallel.replicas": replicas})
    big_cfg = config(**{"algorithm": "single", "data.batch_size": 8 * replicas})
    vm, big = build(vm_cfg), build(big_cfg)
    state = vm.state  # sizes first: the timed calls donate the state's buffers
    per_replica = comms.payload_bytes(jax.tree.map(lambda x: x[0], state.params))
    per_replica += comms.payload_bytes(jax.tree.map(lambda x: x[0], state.inner_state))
    shared = comms.payload_bytes(state.anchor)
    shared += comms.payload_bytes(state.outer_state)
    flops = flops_per_token(vm, vm_cfg)
    vm_s, vm_compiled = timed(vm, vm_cfg, calls)
    big_s, big_compiled = timed(big, big_cfg, calls)
    tokens = 10 * replicas * 8 * 64  # per call, both
    return {
        "R": replicas,
        "vmap_tok_s": tokens / vm_s,
        "big_tok_s": tokens / big_s,
        "ratio": big_s / vm_s,
        "vmap_mib": xla_mib(vm_compiled),
        "big_mib": xla_mib(big_compiled),
        "state_mib": (replicas * per_replica + shared) / 2**20,
        "mfu": tokens / vm_s * flops / peak,
    }


def outer_share(replicas: int, calls: int, sync_every: int = 100) -> float:
    """The outer step's share of a round of ``sync_every`` steps. The cost of one sync is
    measured as (a 100-step call syncing every step - one never syncing) / 100: a signal 100x
    larger than one sync in one round, which this noisy machine would drown."""
    kw = {"parallel.replicas": replicas, "train.log_every": 100}
    every = config(**kw, **{"outer.sync_every": 1})
    never = config(**kw, **{"outer.sync_every": 1_000_000})
    t_every, _ = timed(build(every), every, calls)
    t_never, _ = timed(build(never), never, calls)
    sync_s = max(t_every - t_never, 0.0) / 100
    step_s = t_never / 100
    return sync_s / (sync_every * step_s + sync_s)


def training_loop(replicas: int, cpu_devices: int, steps: int = 300) -> dict:
    """The command a user runs, on the standard workload: ``python -m diloco_jax.train`` with
    ``replicas`` replicas for ``steps`` steps (evaluations, final checkpoint and sample as by
    default) in a child process, the CPU split into ``cpu_devices`` XLA devices (0: the default
    choice): its wall time, steady tokens/s (median over the logged calls after the first), host
    work per call and peak RSS."""
    overrides = {**WORKLOAD, "parallel.replicas": replicas, "train.total_steps": steps,
                 "log.progress_bar": "false", "parallel.runtime": "auto",
                 "parallel.cpu_devices": cpu_devices}  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        flags = [f"--config.{k}={v}" for k, v in overrides.items()]
        cmd = [sys.executable, "-m", "diloco_jax.train", "--config", "default", "--workdir",
               f"{workdir}/run", *flags]  # fmt: skip
        with open(f"{workdir}/log.txt", "w") as log:
            start = time.perf_counter()
            # from another directory, as a user would (python -m would import ./diloco_jax)
            child = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=workdir)
            _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS
            seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, not Popen
        if child.returncode:
            tail = open(f"{workdir}/log.txt").read()[-2000:]
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{tail}")
        events = [json.loads(x) for x in open(f"{workdir}/run/metrics.jsonl")]
        layout = open(f"{workdir}/log.txt").read().split(" replicas on ", 1)[1].split(",")[0] + ")"
    rates = [e["tokens_per_s"] for e in events if e["event"] == "train"][1:]
    done = next(e for e in events if e["event"] == "done")
    return {
        "runtime": layout,
        "seconds": seconds,
        "tok_s": float(np.median(rates)),
        "host_ms_per_call": 1e3 * done["host_seconds"],
        "rss_mib": usage.ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="1,4,8,16")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument(
        "--share_replicas",
        default="4,8",
        help="replica counts of the outer-step share ('' for none)",
    )
    parser.add_argument(
        "--loop_replicas",
        default="4,8",
        help="replica counts of the training-loop runs ('' for none)",
    )
    parser.add_argument(
        "--fma_units",
        type=int,
        default=2,
        help="FMA units per core (2 on current x86 server cores)",
    )
    parser.add_argument(
        "--clock_ghz",
        type=float,
        default=None,
        help="clock for the theoretical peak (default: /proc/cpuinfo)",
    )
    args = parser.parse_args()
    peak = matmul_flops_per_s()
    if jax.default_backend() == "cpu":
        theory, how = cpu_peak_flops_per_s(args.fma_units, args.clock_ghz)
    else:  # the CPU's peak says nothing of an accelerator's; its matmul rate is the yardstick
        theory, how = float("nan"), f"not computed for {jax.default_backend()}"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; measured fp32 matmul rate "
          f"{peak / 1e9:.1f} GFLOP/s (2048x2048); theoretical peak {theory / 1e9:.1f} GFLOP/s "
          f"({how}): {check_rate(peak, theory)}")  # fmt: skip
    for r in (int(x) for x in args.loop_replicas.split(",") if x):
        rate = workload_matmul_rate(r)
        print(f"the workload's own Linear matmuls (forward + 2 gradient matmuls), R={r}: "
              f"{rate / 1e9:.1f} GFLOP/s, {rate / peak:.2f} of the 2048x2048 rate")  # fmt: skip
    print()
    print_simulator_table([int(x) for x in args.replicas.split(",") if x], args.calls, peak)
    for r in (int(x) for x in args.share_replicas.split(",") if x):
        share = outer_share(r, args.calls)
        print(f"\nouter step share of a 100-step round, R={r}: {100 * share:.2f}%")
    print_loop_table([int(x) for x in args.loop_replicas.split(",") if x], peak)


def print_simulator_table(replicas: list[int], calls: int, peak: float) -> None:
    """Vmapped workers against one big model, for each R: tokens/s, MFU, XLA's memory."""
    if replicas:
        print("| R | vmapped tok/s | one model (batch 8R) tok/s | ratio | MFU | XLA MiB vmapped | "
              "XLA MiB one model | state MiB: R(params+inner)+anchor+outer |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in replicas:
        row = bench_replicas(r, calls, peak)
        print(f"| {r} | {row['vmap_tok_s']:,.0f} | {row['big_tok_s']:,.0f} | {row['ratio']:.2f} | "
              f"{row['mfu']:.3f} | {row['vmap_mib']:.1f} | {row['big_mib']:.1f} | "
              f"{row['state_mib']:.2f} |")  # fmt: skip


def print_loop_table(loops: list[int], peak: float) -> None:
    """The training command itself, for each R, with the CPU as one device and split."""
    if not loops:
        return
    vm = build(config(**{"parallel.replicas": loops[0]}))
    flops = flops_per_token(vm, config())
    print("\ntraining loop (python -m diloco_jax.train, standard workload, 300 steps):\n")
    print("| R | parallel.cpu_devices | runtime | command (s) | steady tok/s | model GFLOP/s "
          "| of matmul rate | host ms per call | peak RSS (MiB) |")  # fmt: skip
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for r, devices in ((r, d) for r in loops for d in (1, 0)):
        row = training_loop(r, devices)
        rate = row["tok_s"] * flops
        print(f"| {r} | {devices or '0 (default)'} | {row['runtime']} | {row['seconds']:.1f} | "
              f"{row['tok_s']:,.0f} | {rate / 1e9:.1f} | "
              f"{rate / peak:.2f} | {row['host_ms_per_call']:.1f} | "
              f"{row['rss_mib']:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
