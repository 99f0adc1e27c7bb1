"""Benchmark: how much of a round's communication overlapped rounds hide, measured.

    uv run python scripts/bench_overlap.py [--learners 2] [--rounds 12] [--sync_every 40]
        [--out DIR]

Two runs of ``diloco-launch --learners L`` on this machine (the job of
``scripts/bench_learners.py``: the tiny preset at d_model 64, one replica per learner, no
failures): synchronous rounds (``outer.mode=sync``: at each sync a learner pushes and waits for
the round to close) and overlapped rounds (``outer.mode=delayed``: it pushes in the background,
trains on, and at the next sync takes the answer of the push before). From every learner's
``round`` events: the seconds a sync stood waiting (``seconds_waited``) and the seconds from
sending a push to its answer (``seconds_in_flight``: the transfer both ways, waiting for the
other learners, the syncer's outer step and checkpoint). ``hidden`` is the share of the time
in flight that the learner spent training instead of waiting: ``1 - waited / in flight``.
Also the wall time and the final evaluation loss (the delayed outer step is another algorithm:
the loss is not the synchronous one's). Prints a Markdown table and writes
``DIR/bench_overlap.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from bench_command import cpu_name  # scripts/: this script's own folder
from bench_learners import ROOT, env, events, job_flags, tape


def run(args, workdir: pathlib.Path, mode: str) -> dict:
    steps = args.rounds * args.sync_every
    flags = [*job_flags(args, steps), "--config.parallel.replicas=1",
             f"--config.outer.mode={mode}", "--config.syncer.heartbeat=0.5",
             "--config.syncer.timeout=120"]  # fmt: skip
    command = [sys.executable, "-m", "diloco_jax.launch", "--learners", str(args.learners), "--",
               *flags, "--workdir", str(workdir)]  # fmt: skip
    start = time.monotonic()
    rc = subprocess.run(command, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL).returncode  # fmt: skip
    wall = time.monotonic() - start
    rounds, losses = [], []
    for i in range(args.learners):
        metrics = workdir / f"learner_{i}" / "metrics.jsonl"
        rounds += events(metrics, "round")
        losses += [d["final_eval_loss"] for d in events(metrics, "done")]
    waited = sum(e["seconds_waited"] for e in rounds)
    flight = sum(e["seconds_in_flight"] for e in rounds)
    closed = sum(e["event"] == "closed" for e in tape(workdir))
    return {"rc": rc, "wall_s": wall, "rounds": closed,
            "waited_per_round_s": waited / max(len(rounds), 1),
            "in_flight_per_round_s": flight / max(len(rounds), 1),
            "hidden": max(0.0, 1 - waited / flight) if flight else 0.0,
            "final_eval_loss": max(losses) if losses else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--sync_every", type=int, default=40)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="bench_overlap_"))
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in ("sync", "delayed"):
        results[mode] = run(args, out / mode, mode)
        print(f"{mode}: {json.dumps(results[mode])}", file=sys.stderr, flush=True)
    (out / "bench_overlap.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.learners} learners x 1 replica, {args.rounds} rounds of {args.sync_every} "
          f"steps, no failures; {cpu_name()}, {os.cpu_count()} cores\n")  # fmt: skip
    print("| outer.mode | wall s | rounds | waited per round s | in flight per round s | "
          "hidden | final eval loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        loss = f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] is not None else "-"
        print(f"| {mode} | {r['wall_s']:.1f} | {r['rounds']} | {r['waited_per_round_s']:.3f} | "
              f"{r['in_flight_per_round_s']:.3f} | {r['hidden']:.0%} | {loss} |")  # fmt: skip
    print(f"\nresults: {out / 'bench_overlap.json'}")


if __name__ == "__main__":
    main()
