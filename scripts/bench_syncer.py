"""Benchmark: the syncer of independent learners at real model sizes, over its real gRPC service
on localhost with TLS.

    uv run python scripts/bench_syncer.py [--params 25e6,100e6] [--learners 1,4,8,16]
        [--rounds 2] [--leaves 4] [--join_anchor first|all] [--out runs/bench_syncer/results]

Per configuration (a model of ``--params`` float32 parameters in ``--leaves`` equal leaves, and
``--learners`` learners): the syncer serves in a subprocess of its own (this script's
``--serve`` mode: plain DiLoCo, synchronous rounds) with a fresh workdir; the learners are
client threads of this process, each with its own credential and TLS folder. Threads, not
processes: the client's work (TLS, framing, the checksum) is in gRPC's C core and hashlib, which
release the GIL, and on a machine of few cores more processes would only contend with the
syncer's. Learner 0 joins first with the initial anchor (zeros), the others after it (with
``--join_anchor all`` each sends its anchor too, as the real learner does); then every round
each learner pushes the same random pseudo-gradient. A further client beats for learner 0 every
50 ms during the rounds.

Reported: the syncer's peak RSS (VmHWM of its process, reset after the joins, and VmRSS sampled
every 50 ms), as GB and as a multiple of the model's bytes; seconds per round's close (merge,
outer step, checkpoint: the tape's ``closed`` events, rounds after the first where there are
several, since the first compiles the outer step); ingest (see ``INGEST``); heartbeat latency
(max and p99, and max while a checkpoint was written, from the tape's times). A projection to
1 B parameters x the most learners measured, from the RSS and close-time slopes over the sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np
from bench_command import cpu_name  # scripts/: this script's own folder

from diloco_jax.learners import certs, identity, service

ROOT = pathlib.Path(__file__).resolve().parent.parent
INGEST = ("ingest MB/s: the bytes of all of a round's pushes (their float32 arrays) over the "
          "time from the first push's call to the last push entering the round (its 'pushed' "
          "event in the tape: its data on the syncer's disk and checked)")  # fmt: skip
TARGETS = {"rss": "peak RSS <= 4 x model + 1 GB (at the most learners)",
           "ingest": "ingest >= 300 MB/s", "heartbeat": "heartbeat <= 1 s during checkpoints"}


def serve(folder: str, workdir: str, learners: int) -> None:
    """``--serve``: a syncer on 127.0.0.1 (a free port, printed), until stdin closes."""
    import optax

    from diloco_jax.algorithm import diloco
    from diloco_jax.learners.syncer import Syncer

    algorithm = diloco(optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9, nesterov=True),
                       sync_every=10)  # fmt: skip
    syncer = Syncer(algorithm, pathlib.Path(workdir), keys={}, learners=learners, timeout=600,
                    dead_after=600)  # fmt: skip
    tls = certs.read(pathlib.Path(folder) / "syncer")
    server = service.Server(syncer, "127.0.0.1", 0, secret=certs.token(pathlib.Path(folder) /
                            "syncer"), tls=tls).start()  # fmt: skip
    print(server.port, flush=True)
    os.dup2(2, 1)  # anything else said goes to stderr: nobody reads the pipe after the port
    sys.stdin.read()
    server.stop()
    syncer.close()


def status_kb(pid: int, key: str) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class Sampler(threading.Thread):
    """VmRSS of ``pid`` every 50 ms: ``samples`` of ``(time, bytes)``."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.samples.append((time.time(), status_kb(self.pid, "VmRSS") * 1024))
            except (OSError, KeyError):
                return

    def peak(self, since: float = 0.0) -> int:
        return max((b for t, b in self.samples if t >= since), default=0)


class Heartbeats(threading.Thread):
    """Learner 0's heartbeat every 50 ms: ``beats`` of ``(start, seconds)``."""

    def __init__(self, client: service.Client, generation: int):
        super().__init__(daemon=True)
        self.client, self.generation = client, generation
        self.beats, self.errors, self.stop = [], [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            start, t0 = time.time(), time.perf_counter()
            try:
                self.client.call("Heartbeat", {"learner": 0, "generation": self.generation},
                                 timeout=60)  # fmt: skip
            except (service.RefusedBySyncer, ConnectionError) as e:
                self.errors.append(str(e))
            self.beats.append((start, time.perf_counter() - t0))


def start_syncer(folder: pathlib.Path, workdir: pathlib.Path, learners: int):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(folder), str(workdir),
                             str(learners)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, cwd=ROOT, text=True)  # fmt: skip
    port = proc.stdout.readline().strip()
    if not port:
        raise RuntimeError(f"the syncer did not start (exit {proc.wait()})")
    return proc, f"127.0.0.1:{port}"


def clients(folder: pathlib.Path, address: str, learners: int) -> list[service.Client]:
    """A client per learner, and a last one for learner 0's heartbeats."""
    secret = certs.token(folder / "syncer")
    return [service.Client(address, identity.learner_credential(secret, i), timeout=900,
                           tls=certs.read(folder / f"learner_{i}"))
            for i in [*range(learners), 0]]  # fmt: skip


def in_threads(fn, n: int) -> list:
    """``fn(i)`` for ``i < n``, each in a thread of its own; their results (raises the first
    error)."""
    out: list = [None] * n

    def one(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def join_all(cls: list[service.Client], push: dict, join_anchor: str) -> list[int]:
    """Learner 0 joins with zeros (the initial anchor), then the others at once; generations."""
    described = [[n, list(a.shape), str(a.dtype)] for n, a in push.items()]

    def join(i: int) -> int:
        bring = i == 0 or join_anchor == "all"
        anchor = {n: np.zeros_like(a) for n, a in push.items()} if bring else {}
        f, _ = cls[i].call("Join", {"learner": i, "describe": described, "keys": {}}, anchor)
        return int(f["generation"])

    first = join(0)
    return [first, *in_threads(lambda i: join(i + 1), len(cls) - 1)]


def push_rounds(cls, generations, push: dict, rounds: int) -> list[list[float]]:
    """Every learner pushes ``push`` each round (together: a barrier); each push's start."""
    barrier, starts = threading.Barrier(len(cls)), [[0.0] * len(cls) for _ in range(rounds)]

    def learner(i: int) -> None:
        for r in range(rounds):
            barrier.wait()
            starts[r][i] = time.time()
            fields = {"learner": i, "generation": generations[i], "round": r, "weight": 1.0,
                      "push": uuid.uuid4().hex}  # fmt: skip
            f, _ = cls[i].call("Push", fields, push)
            assert int(f["round"]) == r + 1, f

    in_threads(learner, len(cls))
    return starts


def run_config(args, folder: pathlib.Path, params: int, learners: int) -> dict:
    n = params // args.leaves
    rng = np.random.default_rng(0)
    push = {f"['w{k}']": rng.normal(0, 1e-3, n).astype(np.float32) for k in range(args.leaves)}
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench_syncer_"))
    proc, address = start_syncer(folder, workdir / "syncer", learners)
    sampler = Sampler(proc.pid)
    sampler.start()
    try:
        cls = clients(folder, address, learners)
        t0 = time.time()
        generations = join_all(cls[:learners], push, args.join_anchor)
        joined = {"s": time.time() - t0, "hwm": status_kb(proc.pid, "VmHWM") * 1024,
                  "rss": status_kb(proc.pid, "VmRSS") * 1024, "sampled": sampler.peak()}
        pathlib.Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        beats = Heartbeats(cls[learners], generations[0])
        rounds_from = time.time()
        beats.start()
        starts = push_rounds(cls[:learners], generations, push, args.rounds)
        beats.stop.set()
        beats.join()
        if beats.errors:
            raise RuntimeError(f"heartbeats failed: {beats.errors[0]}")
        hwm = status_kb(proc.pid, "VmHWM") * 1024
        tape = [json.loads(x) for x in (workdir / "syncer" / "syncer.jsonl").read_text()
                .splitlines()]  # fmt: skip
    finally:
        sampler.stop.set()
        proc.stdin.close()
        proc.wait(120)
        shutil.rmtree(workdir, ignore_errors=True)
    model = sum(a.nbytes for a in push.values())
    return {"params": params, "learners": learners, "model_bytes": model, "join": joined,
            "rounds_hwm": hwm, "rounds_sampled": sampler.peak(rounds_from), "starts": starts,
            "beats": beats.beats, "tape": [e for e in tape if e["event"] in ("pushed", "closed")],
            "rss_trace": sampler.samples[::4]}  # fmt: skip


def summary(raw: dict) -> dict:
    """The reported numbers of one configuration's raw measurements."""
    closed = [e for e in raw["tape"] if e["event"] == "closed"]
    steady = closed[1:] or closed
    close = {k: float(np.mean([e[k] for e in steady])) for k in ("merge_s", "step_s",
                                                                 "checkpoint_s")}  # fmt: skip
    ingest = []
    for r, starts in enumerate(raw["starts"]):
        last = max(e["time"] for e in raw["tape"] if e["event"] == "pushed" and e["round"] == r)
        ingest.append(raw["learners"] * raw["model_bytes"] / 1e6 / (last - min(starts)))
    writing = [(e["time"] - e["checkpoint_s"], e["time"]) for e in closed]
    lat = np.array([s for _, s in raw["beats"]] or [0.0])
    in_ckpt = [s for t, s in raw["beats"] if any(t < b and t + s > a for a, b in writing)]
    peak = max(raw["join"]["hwm"], raw["join"]["sampled"], raw["rounds_hwm"],
               raw["rounds_sampled"])  # fmt: skip
    return {"params": raw["params"], "learners": raw["learners"],
            "model_gb": raw["model_bytes"] / 1e9, "peak_rss_gb": peak / 1e9,
            "x_model": peak / raw["model_bytes"], "join_peak_gb": raw["join"]["hwm"] / 1e9,
            "rounds_peak_gb": max(raw["rounds_hwm"], raw["rounds_sampled"]) / 1e9,
            "close_s": sum(close.values()), **close, "ingest_mb_s": float(np.mean(ingest)),
            "ingest_rounds": ingest, "join_s": raw["join"]["s"],
            "heartbeat_max_s": float(lat.max()), "heartbeat_p99_s": float(np.quantile(lat, 0.99)),
            "heartbeats": len(raw["beats"]), "heartbeats_in_checkpoint": len(in_ckpt),
            "heartbeat_checkpoint_max_s": max(in_ckpt, default=float("nan"))}  # fmt: skip


def projection(rows: list[dict], params: float = 1e9) -> dict | None:
    """RSS and close time at ``params`` parameters x the most learners measured, fitted
    ``a + b * model_bytes`` over the sizes measured there (needs two sizes)."""
    most = max(r["learners"] for r in rows)
    at = [r for r in rows if r["learners"] == most]
    if len({r["params"] for r in at}) < 2:
        return None
    x = np.array([r["model_gb"] for r in at])
    rss = np.polyfit(x, [r["peak_rss_gb"] for r in at], 1)
    close = np.polyfit(x, [r["close_s"] for r in at], 1)
    gb = params * 4 / 1e9
    return {"params": int(params), "learners": most, "model_gb": gb, "rss_fit": list(rss),
            "close_fit": list(close), "peak_rss_gb": float(np.polyval(rss, gb)),
            "x_model": float(np.polyval(rss, gb)) / gb,
            "close_s": float(np.polyval(close, gb))}  # fmt: skip


def table(rows: list[dict], proj: dict | None, machine: str) -> str:
    most = max(r["learners"] for r in rows)
    lines = [machine, "", INGEST + ".", "Targets (not asserted): " + "; ".join(TARGETS.values()),
             "", "| params | learners | model GB | peak RSS GB | x model | (joins / rounds) GB "
             "| close s (merge + step + ckpt) | ingest MB/s | heartbeat max / p99 ms | "
             "max in ckpt ms (beats) | targets |", "|" + "---|" * 11]  # fmt: skip
    for r in rows:
        missed = [k for k, bad in (
            ("rss", r["learners"] == most and r["peak_rss_gb"] > 4 * r["model_gb"] + 1),
            ("ingest", r["ingest_mb_s"] < 300),
            ("heartbeat", not r["heartbeat_checkpoint_max_s"] <= 1.0)) if bad]  # fmt: skip
        lines.append(
            f"| {r['params'] / 1e6:g} M | {r['learners']} | {r['model_gb']:.3f} | "
            f"{r['peak_rss_gb']:.2f} | {r['x_model']:.1f} | {r['join_peak_gb']:.2f} / "
            f"{r['rounds_peak_gb']:.2f} | {r['close_s']:.2f} ({r['merge_s']:.2f} + "
            f"{r['step_s']:.2f} + {r['checkpoint_s']:.2f}) | {r['ingest_mb_s']:.0f} | "
            f"{r['heartbeat_max_s'] * 1e3:.0f} / {r['heartbeat_p99_s'] * 1e3:.0f} | "
            f"{r['heartbeat_checkpoint_max_s'] * 1e3:.0f} ({r['heartbeats_in_checkpoint']}) | "
            f"{'missed: ' + ', '.join(missed) if missed else 'met'} |")  # fmt: skip
    if proj:
        lines.append(f"| {proj['params'] / 1e9:g} B (projection) | {proj['learners']} | "
                     f"{proj['model_gb']:.2f} | {proj['peak_rss_gb']:.2f} | "
                     f"{proj['x_model']:.1f} | | {proj['close_s']:.1f} | | | | "
                     f"{'missed: rss' if proj['peak_rss_gb'] > 4 * proj['model_gb'] + 1 else ''}"
                     " |")  # fmt: skip
        lines += ["", "The last row is a projection, not a measurement: linear fits of peak RSS "
                  f"and close time against the model's bytes at {proj['learners']} learners "
                  "over the sizes measured."]  # fmt: skip
    return "\n".join(lines)


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="25e6,100e6", help="model sizes (comma list)")
    parser.add_argument("--learners", default="1,4,8,16", help="learner counts (comma list)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--leaves", type=int, default=4, help="equal float32 leaves")
    parser.add_argument("--join_anchor", choices=("first", "all"), default="first",
                        help="who sends an anchor with its join (all: as the real learner)")
    parser.add_argument("--out", default="runs/bench_syncer/results",
                        help="writes OUT.json and OUT.md")  # fmt: skip
    return parser.parse_args(argv)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        return serve(*sys.argv[2:4], int(sys.argv[4]))
    args = arguments()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    machine = (f"{cpu_name()}, {os.cpu_count()} cores, commit {commit}; "
               f"`{' '.join(['python', 'scripts/bench_syncer.py', *sys.argv[1:]])}`")  # fmt: skip
    sizes = [int(float(p)) for p in args.params.split(",")]
    counts = [int(n) for n in args.learners.split(",")]
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench_syncer_certs_"))
    certs.make(folder, max(counts), certs.DEFAULT_HOSTS, log=lambda _: None)
    raws, rows = [], []
    for params in sizes:
        for learners in counts:
            raws.append(run_config(args, folder, params, learners))
            rows.append(summary(raws[-1]))
            print(json.dumps({k: v for k, v in rows[-1].items()}), file=sys.stderr, flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    proj = projection(rows)
    text = table(rows, proj, machine)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows,
                                                    "projection": proj, "raw": raws}))  # fmt: skip


if __name__ == "__main__":
    main()
