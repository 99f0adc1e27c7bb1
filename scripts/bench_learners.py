"""Benchmark: goodput of L learners and a syncer against one SPMD job, under the same failures.

    uv run python scripts/bench_learners.py [--learners 4] [--rounds 16] [--sync_every 40]
        [--kill_every 4] [--slow 0.5] [--quorum 2] [--unweighed] [--late_weight 0.5]
        [--layouts learners,SPMD] [--pin auto|on|off] [--out DIR] [--predict_from DIR]

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

Before the timed runs, each layout runs once untimed (one round) into the bench's own
compilation cache (``DIR/xla_cache``): every timed run and every restart then loads its compiled
programs, so a layout's first run does not pay a compile its second one skips. With ``--pin``
(the default where there is a core per learner) learner ``i``'s processes run on core ``i``
alone, as on machines of their own; the SPMD job has all the cores.

Then the predictions: the learners' runs replayed on a virtual clock by the real syncer's rules
(``sim/replay.py``) at the pace measured in the run without failures (each learner's step, the
syncer's turn-around, start-up, compile, tail) and the restart times measured in the run with
them; the SPMD runs on the simulator's network clock (``sim/clock.py``) at the step time of the
run without failures, plus its start-up and the restarts measured in the run with them. A second
table sets the predicted wall time and goodput against the measured. ``--predict_from DIR``
prints both tables again for a finished ``--out DIR`` without running anything.
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
import time

import numpy as np
from bench_command import cpu_name  # scripts/: this script's own folder
from processes import Spawns, Throttle, events, pid_of

from diloco_jax import config as config_lib
from diloco_jax.simulated import comms
from sim import clock, replay

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


def tape(workdir: pathlib.Path) -> list[dict]:
    path = workdir / "syncer" / "syncer.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def finished(workdir: pathlib.Path) -> bool:
    return any(e["event"] == "finished" for e in tape(workdir))


def learner_flags(args, failures: bool, rounds: int = 0) -> list[str]:
    steps = args.rounds * args.sync_every * 2  # at most; the examples budget ends the run
    budget = args.learners * (rounds or args.rounds) * args.sync_every * BATCH  # SPMD's examples
    flags = [*job_flags(args, steps), "--config.parallel.replicas=1",
             f"--config.syncer.examples={budget}", "--config.syncer.heartbeat=0.5",
             "--config.syncer.dead_after=20", "--config.syncer.timeout=120"]  # fmt: skip
    if failures:
        flags += [f"--config.syncer.quorum={args.quorum}", "--config.syncer.grace=2",
                  "--config.syncer.max_late=8"]  # fmt: skip
    if args.unweighed:
        flags.append("--config.syncer.weigh_rounds=false")
    flags.append(f"--config.syncer.late_weight={args.late_weight}")
    return flags


def run_learners(args, workdir: pathlib.Path, failures: bool, rounds: int = 0) -> dict:
    flags = learner_flags(args, failures, rounds)
    command = [sys.executable, "-m", "diloco_jax.launch", "--learners", str(args.learners),
               "--max_restarts", "1000", "--", *flags, "--workdir", str(workdir)]  # fmt: skip
    last = args.learners - 1
    started, start = time.time(), time.monotonic()
    proc = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    kills = 0
    speed = args.slow if failures else 1.0
    spawns = Spawns(workdir, args.learners, args.pin)
    with Throttle(lambda: pid_of("diloco_jax.train", f"{workdir}/learner_{last}"), speed):
        while proc.poll() is None:
            spawns.look()
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
        "started": started,
        "spawned": spawns.times,
        "useful_steps": useful,
        "kills": kills,
        "rc": proc.returncode,
        "final_eval_loss": min(losses) if losses else None,
        "rounds": sum(e["event"] == "closed" for e in t),
        "late_pushes": sum(len(e.get("late", [])) for e in t if e["event"] == "closed"),
    }


def run_spmd(args, workdir: pathlib.Path, failures: bool, rounds: int = 0) -> dict:
    """``rounds``: stop (SIGKILL) after that many syncs, as a warm-up."""
    steps = args.rounds * args.sync_every
    flags = [*job_flags(args, steps), f"--config.parallel.replicas={args.learners}",
             "--config.parallel.runtime=mesh", "--workdir", str(workdir)]  # fmt: skip
    e = env()
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.learners}"
    start, kills, rc = time.monotonic(), 0, None
    spawned, kill_steps = [], []
    speed = args.slow if failures else 1.0
    with Throttle(lambda: pid_of("diloco_jax.train", str(workdir)), speed):
        while rc != 0:
            spawned.append(time.time())
            proc = subprocess.Popen([sys.executable, "-m", "diloco_jax.train", *flags], cwd=ROOT,
                                    env=e, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)  # fmt: skip
            while proc.poll() is None:
                synced = {x["step"] for x in events(workdir / "metrics.jsonl", "sync")}
                syncs = len(synced)
                if rounds and syncs >= rounds:
                    proc.send_signal(signal.SIGKILL)
                    return {"wall_s": time.monotonic() - start}
                if failures and syncs >= (kills + 1) * args.kill_every and syncs < args.rounds:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    kills += 1
                    kill_steps.append(max(synced))
                    break
                time.sleep(0.05)
            rc = proc.wait()
            if rc not in (0, -signal.SIGKILL):
                raise RuntimeError(f"the SPMD run failed with status {rc}")
    wall = time.monotonic() - start
    done = events(workdir / "metrics.jsonl", "done")
    return {
        "wall_s": wall,
        "spawned": spawned,
        "kill_steps": kill_steps,
        "useful_steps": float(args.learners * steps),
        "kills": kills,
        "rc": rc,
        "final_eval_loss": done[-1]["final_eval_loss"] if done else None,
        "rounds": args.rounds,
        "late_pushes": 0,
    }


def predicted_learners(args, out: pathlib.Path, results: dict) -> dict:
    """The learners' runs replayed (``sim/replay.py``) on the times measured in the run without
    failures and the restart times of the run with them: the first (a check of the model) and
    the failure schedule (a prediction of its wall time and useful work)."""
    clean, chaos = results["learners, no failures"], results["learners, failures"]
    pace = replay.measure(out / "learners_no_failures", clean["started"], clean["wall_s"],
                          clean["spawned"])  # fmt: skip
    pace = replay.measure_restarts(out / "learners_failures", chaos["spawned"], pace)
    speeds = [1.0] * (args.learners - 1) + [args.slow]
    preds = {}
    for failures in (False, True):
        cfg = config_lib.load_preset("tiny")
        for flag in learner_flags(args, failures)[2:]:  # after "--config tiny"
            key, _, text = flag.removeprefix("--config.").partition("=")
            cfg = config_lib.override(cfg, key, text)
        cfg = config_lib.override(cfg, "syncer.learners", str(args.learners))
        kw = {"speeds": speeds, "kill": (0, args.kill_every)} if failures else {}
        r = replay.replay(cfg, pace, **kw)
        fields = ("wall_s", "useful_steps", "rounds", "kills", "late_pushes")
        preds[f"learners, {'failures' if failures else 'no failures'}"] = {
            k: getattr(r, k) for k in fields}  # fmt: skip
    measured = {k: _round(v) for k, v in pace._asdict().items()}
    print(f"the pace the replay measured: {json.dumps(measured)}", file=sys.stderr)
    return preds


def _round(v):
    return [round(x, 4) for x in v] if isinstance(v, tuple) else round(v, 3)


def spmd_restarts(workdir: pathlib.Path, run: dict, step_s: float) -> tuple[float, int]:
    """``(seconds, steps)`` the SPMD run's restarts cost: each new process's start to its first
    ``train`` event, less that event's steps since its resume (``run_record.jsonl``), and the
    steps done again (from its resume back to the step it was killed at)."""
    trains = events(workdir / "metrics.jsonl", "train")
    resumed = [e["step"] for e in map(json.loads, (workdir / "run_record.jsonl").read_text()
                                      .splitlines()) if e.get("command")]  # fmt: skip
    seconds, again = 0.0, 0
    for start, resume, killed in zip(run["spawned"][1:], resumed[1:], run["kill_steps"],
                                     strict=False):  # fmt: skip
        first = next(e for e in trains if e["time"] > start)
        seconds += first["time"] - start - (first["step"] - resume) * step_s
        again += killed - resume
    return seconds, again


def predicted_spmd(args, out: pathlib.Path, results: dict) -> dict:
    """The SPMD runs on the simulator's network clock (``sim/clock.py``: every round waits for
    its slowest replica) at the step time measured in the run without failures, plus its
    start-up and tail, and the restarts the run with failures measured (:func:`spmd_restarts`);
    the throttled process is slow at all of it."""
    clean, chaos = results["SPMD, no failures"], results["SPMD, failures"]
    metrics = events(out / "SPMD_no_failures" / "metrics.jsonl", "train")
    H, steps = args.sync_every, args.rounds * args.sync_every
    step_s = float(np.median(np.diff([e["time_s"] for e in metrics]))) / (
        metrics[1]["step"] - metrics[0]["step"])  # fmt: skip
    overhead = clean["wall_s"] - steps * step_s  # start-up, compile, final evaluation, exit
    preds = {}
    for failures in (False, True):
        speeds = np.array([1.0] * (args.learners - 1) + [args.slow if failures else 1.0])
        c = clock.simulate(algorithm="diloco", steps=steps, sync_every=H, replicas=args.learners,
                           speeds=speeds, dylu=False, step_time_s=step_s, payload_bytes=0,
                           network=comms.NETWORKS["datacenter"])  # fmt: skip
        again_s, again_steps = 0.0, 0
        if failures:
            again_s, again_steps = spmd_restarts(out / "SPMD_failures", chaos, step_s)
        wall = c.wallclock_s + (overhead + again_steps * step_s) / speeds.min() + again_s
        preds[f"SPMD, {'failures' if failures else 'no failures'}"] = {
            "wall_s": wall,
            "useful_steps": float(args.learners * steps),
            "kills": chaos["kills"] if failures else 0,
        }
    return preds


def print_predictions(args, results: dict, preds: dict) -> None:
    print("\n| run | wall s | predicted | error | goodput | predicted | error |")
    print("|---|---|---|---|---|---|---|")
    for name, p in preds.items():
        r = results[name]
        clean = results[name.split(",")[0] + ", no failures"]
        pace = clean["useful_steps"] / args.learners / clean["wall_s"]
        hosts = args.learners - 1 + args.slow if "no failures" not in name else args.learners
        p["goodput"] = p["useful_steps"] / (p["wall_s"] * pace * hosts)
        print(f"| {name} | {r['wall_s']:.1f} | {p['wall_s']:.1f} | "
              f"{p['wall_s'] / r['wall_s'] - 1:+.1%} | {r['goodput']:.0%} | {p['goodput']:.0%} | "
              f"{p['goodput'] / r['goodput'] - 1:+.1%} |")  # fmt: skip


def arguments() -> argparse.Namespace:
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
        default=0.5,
        help="syncer.late_weight: a late push's merge weight x this per round",
    )
    parser.add_argument("--layouts", default="learners,SPMD", help="which runs (comma list)")
    parser.add_argument(
        "--pin",
        choices=("auto", "on", "off"),
        default="auto",
        help="learner i on core i (auto: when there is a core per learner)",
    )
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--predict_from",
        default="",
        metavar="DIR",
        help="no runs: the predictions for a finished --out DIR (the same flags)",
    )
    return parser.parse_args()


def main() -> None:
    args = arguments()
    cores = sorted(os.sched_getaffinity(0))
    args.pin = args.pin == "on" or (args.pin == "auto" and len(cores) >= args.learners)
    layouts = args.layouts.split(",")
    if args.predict_from:
        out = pathlib.Path(args.predict_from)
        results = json.loads((out / "bench_learners.json").read_text())
        return report(args, out, results, layouts)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="bench_learners_"))
    out.mkdir(parents=True, exist_ok=True)
    # the bench's own compilation cache, filled first: every timed run and restart loads its
    # programs (else a layout's first run pays a compile its second does not)
    os.environ["DILOCO_COMPILE_CACHE"] = str(out / "xla_cache")
    for layout, fn in (("learners", run_learners), ("SPMD", run_spmd)):
        if layout in layouts:
            took = fn(args, out / f"warm_up_{layout}", False, rounds=1)["wall_s"]
            print(f"{layout} warm-up (compiles into the cache): {took:.1f} s", file=sys.stderr)
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
    report(args, out, results, layouts)


def report(args, out: pathlib.Path, results: dict, layouts: list[str]) -> None:
    print(f"\n{args.learners} learners x 1 replica, the examples of {args.rounds} rounds of "
          f"{args.sync_every} steps; failures: learner 0 SIGKILLed every {args.kill_every} "
          f"rounds, learner {args.learners - 1} at {args.slow:.0%} speed, quorum "
          f"{args.quorum}; {cpu_name()}, {os.cpu_count()} cores\n")  # fmt: skip
    if args.pin:
        print("each learner pinned to a core of its own (--pin)\n")
    elif (os.cpu_count() or 1) < args.learners + 1:
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
    preds = {}
    if "learners" in layouts:
        preds |= predicted_learners(args, out, results)
    if "SPMD" in layouts:
        preds |= predicted_spmd(args, out, results)
    print_predictions(args, results, preds)
    (out / "bench_learners_predicted.json").write_text(json.dumps(preds, indent=1))
    print(f"\nresults: {out / 'bench_learners.json'}, {out / 'bench_learners_predicted.json'}")


if __name__ == "__main__":
    main()
