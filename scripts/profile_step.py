"""Profile of one compiled training call: where the time of a step goes, by part of the model.

    uv run python scripts/profile_step.py [--replicas 4] [--mode vmap|single] [--calls 3]
                                          [--out /tmp/profile] [--set KEY=VALUE ...]

Runs the simulator's standard workload (``scripts/bench_sim.py``'s ``WORKLOAD``: 2 layers,
d_model 128, sequence 64, batch 8 per replica, sync_every 10, 10 steps per call) under the JAX
profiler and maps every XLA thunk it ran back to the line of our code (or Flax's, optax's) that
made it, through the compiled HLO's stack frames:

* the compiled HLO goes to ``OUT/step.hlo.txt`` and the trace (TensorBoard/Perfetto) under ``OUT``;
* each thunk's *exclusive* time (its span minus the thunks nested in it, per thread) is put in
  one category: matmuls (a ``dot``, or a library fusion holding one) of the Linear layers or of
  attention, attention's softmax and mask, RMSNorm, GELU, embedding gather and its gradient,
  loss, AdamW, the outer step (the sync branch), data sampling, copies and transposes, the rest;
* ``host`` is the training loop's own time between compiled calls (metrics transfer, logging,
  progress bar): ``train()`` run for the same steps, minus the compiled calls' time.

Thread time can exceed wall time: XLA:CPU runs independent thunks on several threads. The table
gives both, per inner step. ``--set`` overrides a workload key (``--set model.d_model=256``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import pathlib
import re
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_sim import config  # noqa: E402  (scripts/ is not a package)

from diloco_jax import train as train_lib  # noqa: E402
from diloco_jax.run import setup as run_setup  # noqa: E402

CATEGORIES = [
    "matmul: Linear layers", "matmul: attention", "attention softmax, mask", "RMSNorm", "GELU",
    "embedding gather + gradient", "loss (log-softmax)", "AdamW (inner)",
    "outer step (sync branch)", "data sampling", "copies, transposes", "other elementwise",
    "loop control",
]  # fmt: skip


class Hlo:
    """The compiled module's instructions with their opcode, fused body and source line."""

    def __init__(self, text: str):
        def table(name):
            m = re.search(rf"^{name}\n(.*?)\n\n", text, re.S | re.M)
            rows = m.group(1).splitlines() if m else []
            return {int(r.split(" ", 1)[0]): r.split(" ", 1)[1] for r in rows}

        files = {k: v.strip('"') for k, v in table("FileNames").items()}
        funcs = {k: v.strip('"') for k, v in table("FunctionNames").items()}
        nums = {k: dict((a, int(b)) for a, b in re.findall(r"(\w+)=(\d+)", v))
                for k, v in table("FileLocations").items()}  # fmt: skip
        frames = {k: dict((a, int(b)) for a, b in re.findall(r"(\w+)=(\d+)", v))
                  for k, v in table("StackFrames").items()}  # fmt: skip
        self.bodies = dict(re.findall(r"^%?([\w.\-]+) \(.*?\{\n(.*?)\n\}", text, re.S | re.M))
        self.ops = {}
        for m in re.finditer(r"^\s+(?:ROOT )?%([\w.\-]+) = \S+ ([\w\-]+)\((.*)$", text, re.M):
            name, opcode, rest = m.groups()
            frame = re.search(r"stack_frame_id=(\d+)", rest)
            where = None
            if frame and int(frame.group(1)) in frames:
                loc = nums[frames[int(frame.group(1))]["file_location_id"]]
                where = (files[loc["file_name_id"]], funcs[loc["function_name_id"]], loc["line"])
            called = re.search(r"calls=%([\w.\-]+)", rest)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            self.ops[name] = {
                "opcode": opcode,
                "where": where,
                "calls": called.group(1) if called else None,
                "op_name": op_name.group(1) if op_name else "",
            }

    def has_dot(self, name: str) -> bool:
        op = self.ops[name]
        body = self.bodies.get(op["calls"] or "", "")
        return op["opcode"] in ("dot", "convolution") or " dot(" in body


def _source_line(path: str, line: int, cache={}) -> str:  # noqa: B006 (a memo)
    if path not in cache:
        try:
            cache[path] = pathlib.Path(path).read_text().splitlines()
        except OSError:
            cache[path] = []
    lines = cache[path]
    return lines[line - 1] if 0 < line <= len(lines) else ""


def categorize(hlo: Hlo, name: str) -> str:
    """The category of thunk ``name`` (an HLO instruction of the compiled module)."""
    op = hlo.ops.get(name)
    if op is None or op["opcode"] in ("while", "conditional", "call"):
        return "loop control"
    if name.startswith(("copy", "transpose")) or op["opcode"] in ("copy", "transpose"):
        return "copies, transposes"
    path, func, line = op["where"] or ("", "", 0)
    base, text = pathlib.Path(path).name, _source_line(path, line) if path else ""
    attention = func == "Attention.__call__"
    if hlo.has_dot(name):  # a library fusion may hold a norm's or bias's work beside the dot
        scores = attention and ("logits" in text or "probs" in text)  # q.k and probs.v
        return "matmul: attention" if scores else "matmul: Linear layers"
    if attention:
        return "attention softmax, mask"
    if base == "normalization.py" or "norm" in func.lower():
        return "RMSNorm"
    if "gelu" in text:
        return "GELU"
    if "embed" in text or func.startswith("Embed"):
        return "embedding gather + gradient"
    if "token_nll" in text or func == "token_nll" or "log_softmax" in text:
        return "loss (log-softmax)"
    if func in ("Diloco._start", "Diloco._land", "_maybe.<locals>.run") or base in (
        "exchange.py",
        "diagnostics.py",
        "compress.py",
        "timing.py",
    ):
        return "outer step (sync branch)"
    if "optax" in path or func.startswith(("maskable", "inner_adamw")):
        return "AdamW (inner)"
    if base in ("corpus.py", "randomness.py", "images.py"):
        return "data sampling"
    return "other elementwise"


def exclusive_times(trace_file: str) -> collections.Counter:
    """Each event name's total time (us) minus the time of events nested in it on its thread."""
    events = json.load(gzip.open(trace_file))
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], e["dur"], e["name"]))
    out = collections.Counter()
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[list] = []  # [end, name, exclusive]
        for ts, dur, name in spans:
            while stack and stack[-1][0] <= ts:
                end, n, excl = stack.pop()
                out[n] += excl
            if stack:
                stack[-1][2] -= dur
            stack.append([ts + dur, name, dur])
        for _, n, excl in stack:
            out[n] += excl
    return out


def profile(cfg, calls: int, out: pathlib.Path) -> dict:
    s = run_setup.build(cfg)
    control = run_setup.chunk_control(cfg, s, 0)
    compiled = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS, control).compile()
    text = compiled.as_text()
    (out / "step.hlo.txt").write_text(text)
    hlo = Hlo(text)
    state = s.state
    for _ in range(2):  # warm-up
        state, metrics = compiled(state, s.replicas_R, s.shards_RxS, control)
        jax.block_until_ready(metrics)
    walls = []
    for _ in range(calls):
        tick = time.perf_counter()
        state, metrics = compiled(state, s.replicas_R, s.shards_RxS, control)
        jax.block_until_ready(metrics)
        walls.append(time.perf_counter() - tick)
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        for _ in range(calls):
            state, metrics = compiled(state, s.replicas_R, s.shards_RxS, control)
            jax.block_until_ready(metrics)
    trace = sorted(glob.glob(str(out / "**" / "*perfetto_trace.json.gz"), recursive=True))[-1]
    per_category = collections.Counter()
    names = collections.defaultdict(collections.Counter)
    for name, us in exclusive_times(trace).items():
        if name in hlo.ops:  # a thunk (the rest: the runtime's and Python's own spans)
            category = categorize(hlo, name)
            per_category[category] += us
            names[category][name] += us
    steps = calls * cfg.train.log_every
    return {
        "wall_ms": float(np.median(walls)) * 1e3 / cfg.train.log_every,
        "thread_ms": {k: v / 1e3 / steps for k, v in per_category.items()},
        "top": {k: v.most_common(3) for k, v in names.items()},
        "steps_per_call": cfg.train.log_every,
    }


def host_overhead(cfg, calls: int) -> tuple[float, float]:
    """(ms per step of the training loop's host work between two calls, ms per step of its
    compiled calls): medians over ``train()`` run for ``calls + 1`` calls (evaluations off)."""
    cfg = config_with(cfg, {"train.total_steps": cfg.train.log_every * (calls + 1),
                            "train.eval_every": 10**9, "train.checkpoint": False,
                            "train.sample_chars": 0})  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        summary = train_lib.train(cfg, workdir)
    steps = cfg.train.log_every
    return 1e3 * summary["host_seconds"] / steps, 1e3 * summary["step_seconds"]


def config_with(cfg, overrides: dict):
    from diloco_jax.config import apply_overrides

    return apply_overrides(cfg, [(k, str(v)) for k, v in overrides.items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--mode",
        choices=("vmap", "single"),
        default="vmap",
        help="vmap: R replicas of batch 8; single: one model at batch 8R",
    )
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", default=None, help="trace and HLO folder (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = {"parallel.replicas": args.replicas}
    if args.mode == "single":
        overrides = {"algorithm": "single", "data.batch_size": 8 * args.replicas}
    overrides.update(kv.split("=", 1) for kv in args.set)
    cfg = config(**overrides)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="profile_step_"))
    out.mkdir(parents=True, exist_ok=True)
    result = profile(cfg, args.calls, out)
    wall = result["wall_ms"]
    thread = result["thread_ms"]
    busy = sum(thread.values())
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.mode}, R={args.replicas}; "
          f"HLO and trace in {out}")  # fmt: skip
    print(f"compiled call: {wall:.2f} ms wall per inner step; thunks busy {busy:.2f} thread-ms "
          f"per step ({busy / wall:.2f} threads on average)\n")  # fmt: skip
    print("| part | thread-ms per step | share of thunk time | largest thunks |")
    print("|---|---:|---:|---|")
    for category in CATEGORIES:
        ms = thread.get(category, 0.0)
        top = ", ".join(n for n, _ in result["top"].get(category, []))
        print(f"| {category} | {ms:.2f} | {100 * ms / busy:.1f}% | {top} |")
    host_ms, call_ms = host_overhead(cfg, args.calls)
    share = 100 * host_ms / (host_ms + call_ms)
    print(f"\ntraining loop (train(), evaluations off): host work between calls (median) "
          f"{host_ms:.2f} ms per step ({share:.1f}% of the loop); compiled calls {call_ms:.2f} ms "
          f"per step")  # fmt: skip


if __name__ == "__main__":
    main()
