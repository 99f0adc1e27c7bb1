"""Benchmark: learners and a syncer across an emulated link, each mode; and the replay's
prediction of each run's wall time from the link's bandwidth and latency.

    uv run python scripts/bench_link.py [--learners 2] [--rounds 12] [--sync_every 40]
        [--links 100mbit:50ms,10gbit:1ms] [--modes sync,delayed,eager,int8]
        [--big_params 100e6] [--big_step_s 0.75] [--out DIR]

Every run is the job of ``scripts/bench_learners.py`` (the tiny preset at d_model 64, one
replica per learner, ``--rounds`` rounds of ``--sync_every`` steps, no failures): a syncer
(``python -m diloco_jax.syncer``) and ``--learners`` learners, each its own process on this
machine, over TLS with the run's certificates, each learner reaching the syncer through its own
:class:`sim.link.Link`.

The links are scaled to the tiny model. A link of bandwidth ``b`` and latency ``l`` between
the datacenters of a ``--big_params`` model (float32 pushes) whose inner step takes
``--big_step_s`` spends ``(4 N / b + l) / (H x step)`` of a round's compute on one transfer.
The bench gives the tiny model's link the same ratio: its bandwidth is ``b x (tiny bytes / big
bytes) x (big step / tiny step)`` and its latency ``l x tiny step / big step``, the tiny
step measured in a first run without a link (which also gives the replay its pace).

The modes: ``sync`` (a learner waits for each answer), ``delayed`` and ``eager``
(``outer.mode``: the push travels while the next round trains), ``int8`` (synchronous, pushes
through ``compress.codec=int8`` at ``compress.min_size=1024``), ``int8+answers`` (the
same, answered through it too: ``compress.answers``), ``stream F=2`` (synchronous, Streaming
DiLoCo's two fragments in turn, a sync every ``sync_every / 2`` steps), ``stream F=2 tau``
(the same, each answer landing ``sync_every / 4`` steps after its sync while the learner trains
on: ``streaming.overlap``). Per run: wall time, seconds a learner waited per round, bytes each
way per round, the final evaluation loss. Then the replay (``sim/replay.py``): the pace of the
run without a link, each push's way up and each answer's way down added by the link's model
(:func:`sim.replay.through_link`, with the run's own bytes), against the measured wall.
Every mode first runs once untimed (six rounds, no link) into the bench's own compilation cache
(``DIR/xla_cache``), so no timed run compiles. Prints a Markdown table and writes
``DIR/bench_link.json``.
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

import numpy as np
from bench_command import cpu_name  # scripts/: this script's own folder
from bench_learners import BATCH, ROOT, events, job_flags, tape

from diloco_jax import config as config_lib
from diloco_jax.launch import free_port
from diloco_jax.learners import certs
from sim import link as link_lib
from sim import replay

MODES = {
    "sync": [],
    "delayed": ["--config.outer.mode=delayed"],
    "eager": ["--config.outer.mode=eager"],
    "int8": ["--config.compress.codec=int8", "--config.compress.min_size=1024"],
    "int8+answers": [
        "--config.compress.codec=int8",
        "--config.compress.min_size=1024",
        "--config.compress.answers=true",
    ],
    "stream F=2": ["--config.streaming.fragments=2"],
    "stream F=2 tau": ["--config.streaming.fragments=2"],
}


def mode_flags(args, mode: str) -> list[str]:
    """The flags of ``mode`` (streaming: a call, and a sync, every ``sync_every / F`` steps)."""
    extra = MODES[mode]
    if mode == "stream F=2":
        extra = [*extra, f"--config.train.log_every={args.sync_every // 2}"]
    if mode == "stream F=2 tau":  # tau: half a period, a call every tau steps
        tau = args.sync_every // 4
        extra = [*extra, f"--config.train.log_every={tau}", f"--config.streaming.overlap={tau}"]
    return extra


def _env() -> dict:
    e = {**os.environ, "TQDM_DISABLE": "1"}
    e.pop("XLA_FLAGS", None)
    e.pop("DILOCO_SERVE_TOKEN", None)  # each process's credential is in its own folder
    return e


def flags(args, mode: str, rounds: int = 0) -> list[str]:
    """A run's flags; ``rounds``: the syncer ends it after that many (the programs are the
    timed run's: their constants, such as the outer schedule's length, depend on the steps)."""
    steps = args.rounds * args.sync_every
    ends = [f"--config.syncer.rounds={rounds}"] if rounds else []
    return [*job_flags(args, steps), "--config.parallel.replicas=1",
            f"--config.syncer.learners={args.learners}", "--config.syncer.heartbeat=0.5",
            "--config.syncer.timeout=300", "--config.syncer.dead_after=60",
            *mode_flags(args, mode), *ends]  # fmt: skip


def run(args, workdir: pathlib.Path, mode: str, link: tuple | None, rounds: int = 0) -> dict:
    """One run: the syncer, a link per learner (``link``: ``(bandwidth B/s, latency s)``;
    None: none), the learners; what they measured. ``rounds``: that many (a warm-up)."""
    workdir.mkdir(parents=True, exist_ok=True)
    creds = workdir / "credentials"
    certs.make(creds, args.learners, list(certs.DEFAULT_HOSTS), log=lambda _: None)
    port = free_port()
    common = flags(args, mode, rounds)
    procs, links = [], []
    start = time.monotonic()
    started = time.time()
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "diloco_jax.syncer", "--workdir", str(workdir / "syncer"),
             *common, f"--config.syncer.address=127.0.0.1:{port}",
             f"--config.syncer.credentials={creds / 'syncer'}"], cwd=ROOT, env=_env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        for i in range(args.learners):
            address = f"127.0.0.1:{port}"
            if link is not None:
                bandwidth, latency = link
                lk = link_lib.Link(("127.0.0.1", port), bandwidth=bandwidth, latency=latency,
                                   seed=i).start()  # fmt: skip
                links.append(lk)
                address = lk.address
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "diloco_jax.train", "--workdir",
                 str(workdir / f"learner_{i}"), *common, f"--config.syncer.address={address}",
                 f"--config.syncer.learner={i}",
                 f"--config.syncer.credentials={creds / f'learner_{i}'}"], cwd=ROOT, env=_env(),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        codes = [p.wait(timeout=args.timeout) for p in procs[1:]]
        wall = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for lk in links:
            lk.stop()
    rounds = [e for i in range(args.learners)
              for e in events(workdir / f"learner_{i}" / "metrics.jsonl", "round")]  # fmt: skip
    done = [events(workdir / f"learner_{i}" / "metrics.jsonl", "done")
            for i in range(args.learners)]  # fmt: skip
    losses = [d[-1]["final_eval_loss"] for d in done if d]
    mean = lambda key: float(np.mean([e[key] for e in rounds])) if rounds else 0.0  # noqa: E731
    return {
        "rc": max(codes) if codes else 1,
        "wall_s": wall,
        "started": started,
        "rounds": sum(e["event"] == "closed" for e in tape(workdir)),
        "waited_per_round_s": mean("seconds_waited"),
        "in_flight_per_round_s": mean("seconds_in_flight"),
        "bytes_up": mean("bytes_sent"),
        "bytes_down": mean("bytes_received"),
        "final_eval_loss": max(losses) if losses else None,
    }


def scaled(args, bandwidth: float, latency: float, tiny_bytes: float, tiny_step_s: float):
    """The tiny model's ``(bandwidth, latency)`` for a link of ``bandwidth`` (B/s) and
    ``latency`` (s) between the datacenters of the ``--big_params`` model (the docstring)."""
    big_bytes = 4 * args.big_params
    return (bandwidth * tiny_bytes / big_bytes * args.big_step_s / tiny_step_s,
            latency * tiny_step_s / args.big_step_s)  # fmt: skip


def predict(args, workdir: pathlib.Path, base: dict, r: dict, mode: str, link) -> float:
    """The replay's wall time of run ``r`` of ``mode`` across ``link``, at the pace of the
    run without a link (``workdir``, ``base``), with ``r``'s bytes each way."""
    pace = replay.measure(workdir, base["started"], base["wall_s"])
    if link is not None:
        pace = replay.through_link(pace, bandwidth=link[0], latency=link[1],
                                   up_bytes=int(r["bytes_up"]),
                                   down_bytes=int(r["bytes_down"]))  # fmt: skip
    cfg = config_lib.load_preset("tiny")
    for flag in flags(args, mode)[2:]:  # after "--config tiny"
        key, _, text = flag.removeprefix("--config.").partition("=")
        cfg = config_lib.override(cfg, key, text)
    rounds = args.rounds
    if cfg.streaming.fragments > 1:  # to the replay, a round of each fragment's sync
        rounds *= cfg.streaming.fragments
        cfg = config_lib.override(cfg, "outer.sync_every", str(args.sync_every * args.rounds
                                                                // rounds))  # fmt: skip
        cfg = config_lib.override(cfg, "streaming.fragments", "1")
    cfg = config_lib.override(cfg, "syncer.rounds", str(rounds))
    cfg = config_lib.override(cfg, "syncer.address", "127.0.0.1:1")  # a learners' run
    return replay.replay(cfg, pace).wall_s


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--sync_every", type=int, default=40)
    p.add_argument(
        "--links",
        default="100mbit:50ms,10gbit:1ms",
        help="BANDWIDTH:LATENCY of each link, between datacenters of the big model",
    )
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--big_params", type=float, default=100e6)
    p.add_argument(
        "--big_step_s",
        type=float,
        default=0.75,
        help="the big model's inner step (0.75 s: 100 M parameters, 0.5 M tokens "
        "a step, at 40%% of an H100's 990 TFLOP/s in bf16)",
    )
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default="")
    args = p.parse_args()
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"--modes: {sorted(unknown)} not in {sorted(MODES)}")
    return args


def main() -> None:
    args = arguments()
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="bench_link_"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    # every mode once, six rounds (an overlapped run takes its first answer at its second
    # sync), into the bench's compilation cache: no timed run compiles
    os.environ["DILOCO_COMPILE_CACHE"] = str(out / "xla_cache")
    for mode in dict.fromkeys(["sync", *args.modes.split(",")]):
        took = run(args, out / f"warm_up_{mode.replace(' ', '_')}", mode, None, rounds=6)
        print(f"{mode} warm-up: {took['wall_s']:.1f} s", file=sys.stderr, flush=True)
    base = run(args, out / "loopback", "sync", None)
    results["loopback, sync"] = {**base, "link": None}
    pace = replay.measure(out / "loopback", base["started"], base["wall_s"])
    tiny_step = float(np.mean(pace.step_s))
    print(f"loopback: {json.dumps(base)}; step {tiny_step * 1e3:.2f} ms", file=sys.stderr)
    for text in args.links.split(","):
        rate_text, _, latency_text = text.partition(":")
        bandwidth, latency = link_lib.rate(rate_text), link_lib.seconds(latency_text)
        assert bandwidth is not None
        link = scaled(args, bandwidth, latency, base["bytes_up"], tiny_step)
        for mode in args.modes.split(","):
            name = f"{text}, {mode}"
            r = run(args, out / f"{rate_text}_{mode.replace(' ', '_')}", mode, link)
            r["link"] = list(link)
            r["predicted_wall_s"] = predict(args, out / "loopback", base, r, mode, link)
            results[name] = r
            print(f"{name}: {json.dumps(r)}", file=sys.stderr, flush=True)
    (out / "bench_link.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.learners} learners x 1 replica, {args.rounds} rounds of {args.sync_every} "
          f"steps (tiny preset, d_model 64, batch {BATCH}); links scaled from a "
          f"{args.big_params:.0e}-parameter model at {args.big_step_s} s a step; "
          f"{cpu_name()}, {os.cpu_count()} cores\n")  # fmt: skip
    print("| link (scaled) | mode | wall s | predicted s | waited per round s | bytes up | "
          "bytes down | final eval loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        scaled_text = (
            "none"
            if r["link"] is None
            else f"{r['link'][0] * 8 / 1e6:.3g} Mbit/s, {r['link'][1] * 1e3:.3g} ms"
        )
        pred = r.get("predicted_wall_s")
        loss = r["final_eval_loss"]
        print(f"| {name.split(', ')[0]} ({scaled_text}) | {name.split(', ')[-1]} | "
              f"{r['wall_s']:.1f} | {'-' if pred is None else f'{pred:.1f}'} | "
              f"{r['waited_per_round_s']:.3f} | {r['bytes_up']:,.0f} | {r['bytes_down']:,.0f} | "
              f"{'-' if loss is None else f'{loss:.4f}'} |")  # fmt: skip
    print(f"\nresults: {out / 'bench_link.json'}")


if __name__ == "__main__":
    main()
