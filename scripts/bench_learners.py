"""Benchmark: goodput of L learners and a syncer against one SPMD job, under the same failures.

    uv run python scripts/bench_learners.py [--learners 4] [--rounds 16] [--sync_every 40]
        [--kill_every 4] [--slow 0.5] [--quorum 2] [--unweighed] [--late_weight 1.0]
        [--layouts learners,SPMD]
        [--out DIR]

Four runs on this machine, each a fresh process tree, of the same DiLoCo job (the tiny preset
at d_model 64, one replica per learner, ``--learners`` replicas in all):

- ``learners, no failures``: ``diloco-launch --learners L``, synchronous rounds;
- ``learners, failures``: the same with quorum rounds (``syncer.quorum = --quorum``, adaptive
  grace); learner 0 is SIGKILLed every ``--kill_every`` closed rounds and started again by the
  launcher (it resumes from its checkpoint and rejoins), and learner L-1 runs at ``--slow`` of
  its speed (SIGSTOP and SIGCONT in turn, a 0.5 s period);
- ``SPMD, no failures``: one process, the mesh runtime with L replicas on L CPU devices;
- ``SPMD, failures``: the same job SIGKILLed on the same schedule (every ``--kill_every`` outer
  steps) and started again from its checkpoint, as a scheduler restarts a failed job; the slow
  host slows the whole job (every step waits for it), so the process runs at ``--slow`` speed.

Every run trains the same examples: ``--rounds`` outer steps of the SPMD job (its
``train.total_steps``), and for the learners the same number of examples merged into the
anchor (``syncer.examples``), however many rounds that takes; the inner learning rate is
constant after its warm-up, so both layouts train the same thing without failures. Reported per
run: wall time (start to end, start-up included), useful replica-steps (the inner steps whose
pseudo-gradient reached the anchor: from the syncer's tape for learners; every step for SPMD,
whose lost work is redone), the rounds it took, and goodput: useful replica-steps over the
replica-steps the machines could have taken in that wall time, each at its own pace (the
layout's failure-free pace, the slow one at ``--slow`` of it):
``useful / (wall x pace x (L - 1 + slow))``. So a failure-free run is 100%, and a slow host
that holds every SPMD replica back costs SPMD its fast hosts' idle time. The pace assumes each
host keeps its own: with fewer cores than learners + 1 they share them, a dead learner's CPU
goes to the others, and the learners' goodput with failures is flattered (the script says so).
Also the final evaluation loss. Prints a Markdown table and writes ``DIR/bench_learners.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench_command import cpu_name  # scripts/: this script's own folder

ROOT = pathlib.Path(__file__).resolve().parent.parent
BATCH = 8
TOKEN = "bench-learners-token"


def job_flags(args, steps: int) -> list[str]:
    return ["--config", "tiny", f"--config.train.total_steps={steps}",
            f"--config.outer.sync_every={args.sync_every}",
            f"--config.train.log_every={args.sync_every}",
            f"--config.train.checkpoint_every={args.sync_every}",
            f"--config.train.eval_every={steps}", "--config.train.sample_chars=0",
            "--config.log.figures=false", "--config.log.progress_bar=false",
            f"--config.data.batch_size={BATCH}", "--config.model.d_model=64",
            "--config.model.num_layers=2", "--config.inner.final_lr_fraction=1.0"]  # fmt: skip


def env() -> dict:
    e = {**os.environ, "DILOCO_SERVE_TOKEN": TOKEN, "TQDM_DISABLE": "1"}
    e.pop("XLA_FLAGS", None)
    return e


def pid_of(*parts: str) -> int | None:
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if all(p in cmdline for p in parts) and "diloco_jax.launch" not in cmdline:
            return int(entry.name)
    return None


class Throttle:
    """Runs a process at ``speed`` of its pace: SIGSTOP and SIGCONT in turn (0.5 s period).
    ``find()`` gives its pid now (it may change when the process is started again)."""

    def __init__(self, find, speed: float):
        self.find, self.speed, self.done = find, speed, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        period = 0.5
        while not self.done.is_set():
            pid = self.find()
            if pid is None:
                time.sleep(0.1)
                continue
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(period * (1 - self.speed))
                os.kill(pid, signal.SIGCONT)
                time.sleep(period * self.speed)
            except ProcessLookupError:
                continue

    def __enter__(self):
        if self.speed < 1:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()
        pid = self.find()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def tape(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "syncer" / "syncer.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def events(path: pathlib.Path, kind: str) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("event") == kind:
            out.append(e)
    return out


def finished(workdir: pathlib.Path) -> bool:
    return any(e["event"] == "finished" for e in tape(workdir))


def run_learners(args, workdir: pathlib.Path, failures: bool) -> dict:
    steps = args.rounds * args.sync_every * 2  # at most; the examples budget ends the run
    budget = args.learners * args.rounds * args.sync_every * BATCH  # the SPMD run's examples
    flags = [*job_flags(args, steps), "--config.parallel.replicas=1",
             f"--config.syncer.examples={budget}", "--config.syncer.heartbeat=0.5",
             "--config.syncer.dead_after=20", "--config.syncer.timeout=120"]  # fmt: skip
    if failures:
        flags += [f"--config.syncer.quorum={args.quorum}", "--config.syncer.grace=2",
                  "--config.syncer.max_late=8"]  # fmt: skip
    if args.unweighed:
        flags.append("--config.syncer.weigh_rounds=false")
    flags.append(f"--config.syncer.late_weight={args.late_weight}")
    command = [sys.executable, "-m", "diloco_jax.launch", "--learners", str(args.learners),
               "--max_restarts", "1000", "--", *flags, "--workdir", str(workdir)]  # fmt: skip
    last = args.learners - 1
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    kills = 0
    speed = args.slow if failures else 1.0
    with Throttle(lambda: pid_of("diloco_jax.train", f"{workdir}/learner_{last}"), speed):
        while proc.poll() is None:
            closed = sum(e["event"] == "closed" for e in tape(workdir))
            if failures and closed >= (kills + 1) * args.kill_every and not finished(workdir):
                pid = pid_of("diloco_jax.train", f"{workdir}/learner_0")
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
            time.sleep(0.05)
    wall = time.monotonic() - start
    t = tape(workdir)
    useful = sum(w / BATCH for e in t if e["event"] == "closed" for w in e["weights"])
    done = [events(workdir / f"learner_{i}" / "metrics.jsonl", "done")
            for i in range(args.learners)]  # fmt: skip
    losses = [d[-1]["final_eval_loss"] for d in done if d]
    return {
        "wall_s": wall,
        "useful_steps": useful,
        "kills": kills,
        "rc": proc.returncode,
        "final_eval_loss": min(losses) if losses else None,
        "rounds": sum(e["event"] == "closed" for e in t),
        "late_pushes": sum(len(e.get("late", [])) for e in t if e["event"] == "closed"),
    }


def run_spmd(args, workdir: pathlib.Path, failures: bool) -> dict:
    steps = args.rounds * args.sync_every
    flags = [*job_flags(args, steps), f"--config.parallel.replicas={args.learners}",
             "--config.parallel.runtime=mesh", "--workdir", str(workdir)]  # fmt: skip
    e = env()
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.learners}"
    start, kills, rc = time.monotonic(), 0, None
    speed = args.slow if failures else 1.0
    with Throttle(lambda: pid_of("diloco_jax.train", str(workdir)), speed):
        while rc != 0:
            proc = subprocess.Popen([sys.executable, "-m", "diloco_jax.train", *flags], cwd=ROOT,
                                    env=e, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)  # fmt: skip
            while proc.poll() is None:
                syncs = len({x["step"] for x in events(workdir / "metrics.jsonl", "sync")})
                if failures and syncs >= (kills + 1) * args.kill_every and syncs < args.rounds:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    kills += 1
                    break
                time.sleep(0.05)
            rc = proc.wait()
            if rc not in (0, -signal.SIGKILL):
                raise RuntimeError(f"the SPMD run failed with status {rc}")
    wall = time.monotonic() - start
    done = events(workdir / "metrics.jsonl", "done")
    return {
        "wall_s": wall,
        "useful_steps": float(args.learners * steps),
        "kills": kills,
        "rc": rc,
        "final_eval_loss": done[-1]["final_eval_loss"] if done else None,
        "rounds": args.rounds,
        "late_pushes": 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--sync_every", type=int, default=40)
    parser.add_argument("--kill_every", type=int, default=4, help="rounds between kills")
    parser.add_argument("--slow", type=float, default=0.5, help="the slow learner's speed")
    parser.add_argument("--quorum", type=int, default=2)
    parser.add_argument(
        "--unweighed",
        action="store_true",
        help="syncer.weigh_rounds=false: every round's outer step on its mean",
    )
    parser.add_argument(
        "--late_weight",
        type=float,
        default=1.0,
        help="syncer.late_weight: a late push's merge weight x this per round",
    )
    parser.add_argument("--layouts", default="learners,SPMD", help="which runs (comma list)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="bench_learners_"))
    layouts = args.layouts.split(",")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, fn, failures in [("learners, no failures", run_learners, False),
                               ("learners, failures", run_learners, True),
                               ("SPMD, no failures", run_spmd, False),
                               ("SPMD, failures", run_spmd, True)]:  # fmt: skip
        if name.split(",")[0] not in layouts:
            continue
        workdir = out / name.replace(", ", "_").replace(" ", "_")
        results[name] = fn(args, workdir, failures)
        print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    for layout in layouts:
        clean, chaos = results[f"{layout}, no failures"], results[f"{layout}, failures"]
        pace = clean["useful_steps"] / args.learners / clean["wall_s"]  # replica-steps/s each
        for r, hosts in ((clean, args.learners), (chaos, args.learners - 1 + args.slow)):
            r["goodput"] = r["useful_steps"] / (r["wall_s"] * pace * hosts)
        chaos["loss_change"] = chaos["final_eval_loss"] - clean["final_eval_loss"]
    (out / "bench_learners.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.learners} learners x 1 replica, the examples of {args.rounds} rounds of "
          f"{args.sync_every} steps; failures: learner 0 SIGKILLed every {args.kill_every} "
          f"rounds, learner {args.learners - 1} at {args.slow:.0%} speed, quorum "
          f"{args.quorum}; {cpu_name()}, {os.cpu_count()} cores\n")  # fmt: skip
    if (os.cpu_count() or 1) < args.learners + 1:
        print(f"note: {os.cpu_count()} cores for {args.learners} learners and a syncer: a killed "
              "or stopped learner frees CPU for the others, so the learners' goodput with "
              "failures is flattered (it can pass 100%); the SPMD job's is not\n")  # fmt: skip
    print("| run | wall s | useful replica-steps | rounds | kills | late pushes | goodput | "
          "final eval loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['wall_s']:.1f} | {r['useful_steps']:.0f} | {r['rounds']} | "
            f"{r['kills']} | "
            f"{r['late_pushes']} | {r['goodput']:.0%} | {r['final_eval_loss']:.4f} |"
        )
    print(f"\nresults: {out / 'bench_learners.json'}")


if __name__ == "__main__":
    main()
