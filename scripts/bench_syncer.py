"""Benchmark: the syncer of independent learners at real model sizes, over its real gRPC service
on localhost with TLS.

    uv run python scripts/bench_syncer.py [--params 25e6,100e6] [--learners 1,4,8,16]
        [--rounds 2] [--leaves 4] [--join_anchor first|all] [--out runs/bench_syncer/results]

Per model size (float32, ``--leaves`` equal leaves) and learner count, the syncer serves plain
DiLoCo in a subprocess of its own (``--serve``, a fresh workdir), so its memory is its own. The
learners are threads of this process, each with its credential and TLS folder (threads: their
work is in gRPC's C core and hashlib, which release the GIL; on few cores more processes would
only take the syncer's CPU). Learner 0 joins with the initial anchor (zeros), the others after
it (``--join_anchor all``: each with an anchor, as the real learner); every round all push the
same pseudo-gradient (:func:`streamed`); a further client beats for learner 0 every 50 ms.

Reported: the syncer's peak RSS (VmHWM, reset after the joins, and VmRSS every 50 ms) in GB and
per model byte; the close's seconds (merge, outer step, checkpoint: the tape's ``closed``
events; rounds after the first, which compiles the step); ingest (:data:`INGEST`); heartbeat
latency, overall and while a checkpoint is written; where memory and time go (:data:`PHASES`);
a projection to 1 B parameters from the slopes over the sizes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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

from diloco_jax.learners import certs, identity, service, wire

ROOT = pathlib.Path(__file__).resolve().parent.parent
INGEST = ("ingest MB/s: the bytes of all of a round's pushes (their float32 arrays) over the "
          "time from the first push's call to the last push entering the round (its 'pushed' "
          "event in the tape: its data on the syncer's disk and checked)")  # fmt: skip
TARGETS = {"rss": "peak RSS <= 4 x model + 1 GB (at the most learners)",
           "ingest": "ingest >= 300 MB/s",
           "heartbeat": "heartbeat <= 1 s during checkpoints"}  # fmt: skip
# the phases of a round (rest: the close after its checkpoint, untimed in the tape: the pushes'
# files removed and the round advanced, under the lock; answer: the new anchor sent back)
PHASES = ("ingest", "merge", "step", "checkpoint", "rest", "answer")


def serve(folder: str, workdir: str, learners: int) -> None:
    """``--serve``: a syncer on 127.0.0.1 (a free port, printed), until stdin closes."""
    import optax

    from diloco_jax.algorithm import diloco
    from diloco_jax.learners.syncer import Syncer

    service.tune_malloc()  # as python -m diloco_jax.syncer does
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


def memory(pid: int, key: str = "VmRSS") -> int:
    """Bytes of ``key`` (VmRSS, VmHWM) in ``/proc/PID/status``."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class Every(threading.Thread):
    """``fn()`` every 50 ms until :attr:`stop`: ``got`` of ``(time, its value)``; ``errors``."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.got, self.errors, self.stop = fn, [], [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.got.append((time.time(), self.fn()))
            except Exception as e:  # noqa: BLE001 - said by the caller
                self.errors.append(f"{type(e).__name__}: {e}")

    def peak(self, since: float = 0.0) -> int:
        return max((b for t, b in self.got if t >= since), default=0)


def heartbeat(client: service.Client, generation: int):
    """A heartbeat of learner 0 (its seconds, as a function to call :class:`Every` 50 ms)."""

    def beat() -> float:
        t0 = time.perf_counter()
        client.call("Heartbeat", {"learner": 0, "generation": generation}, timeout=60)
        return time.perf_counter() - t0

    return beat


def start_syncer(folder: pathlib.Path, workdir: pathlib.Path, learners: int):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(folder), str(workdir),
                             str(learners)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, cwd=ROOT, text=True)  # fmt: skip
    port = proc.stdout.readline().strip()
    if not port:
        raise RuntimeError(f"the syncer did not start (exit {proc.wait()})")
    return proc, f"127.0.0.1:{port}"


def streamed(client: service.Client, name: str, fields: dict, arrays: dict) -> dict:
    """``client.call`` without holding the message: its chunks made as gRPC sends them, the
    reply's data checked (size, checksum) and dropped; the reply's fields. ``call`` keeps the
    whole push and the whole reply, 2 x the model per learner: 16 learner threads of a 0.4 GB
    model did not fit this machine beside the syncer. The syncer sees the same bytes."""
    replies = client._calls[name](wire.encode(fields, arrays), metadata=client._metadata,
                                  timeout=client.timeout)  # fmt: skip
    it = iter(replies)
    header = wire.read_header(it, client.max_bytes)
    wire.read_data(it, header, lambda _: None)
    return header.fields


def clients(folder: pathlib.Path, address: str, learners: int) -> list[service.Client]:
    """A client per learner, and a last one for learner 0's heartbeats."""
    secret = certs.token(folder / "syncer")
    return [service.Client(address, identity.learner_credential(secret, i), timeout=900,
                           tls=certs.read(folder / f"learner_{i}"))
            for i in [*range(learners), 0]]  # fmt: skip


def in_threads(fn, n: int) -> list:
    """``fn(i)`` for ``i < n``, each in a thread of its own; their results (the first error)."""
    with concurrent.futures.ThreadPoolExecutor(max(n, 1)) as pool:
        return list(pool.map(fn, range(n)))


def join_all(cls: list[service.Client], push: dict, join_anchor: str) -> list[int]:
    """Learner 0 joins with zeros (the initial anchor), then the others at once; generations."""
    described = [[n, list(a.shape), str(a.dtype)] for n, a in push.items()]

    def join(i: int) -> int:
        bring = i == 0 or join_anchor == "all"
        anchor = {n: np.zeros_like(a) for n, a in push.items()} if bring else {}
        f = streamed(cls[i], "Join", {"learner": i, "describe": described, "keys": {}}, anchor)
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
            f = streamed(cls[i], "Push", fields, push)
            assert int(f["round"]) == r + 1, f

    in_threads(learner, len(cls))
    return starts


def run_config(args, folder: pathlib.Path, params: int, learners: int) -> dict:
    n = params // args.leaves
    rng = np.random.default_rng(0)
    push = {f"['w{k}']": rng.normal(0, 1e-3, n).astype(np.float32) for k in range(args.leaves)}
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench_syncer_"))
    proc, address = start_syncer(folder, workdir / "syncer", learners)
    sampler = Every(lambda: memory(proc.pid))
    sampler.start()
    try:
        cls = clients(folder, address, learners)
        t0 = time.time()
        generations = join_all(cls[:learners], push, args.join_anchor)
        joined = {"s": time.time() - t0, "hwm": memory(proc.pid, "VmHWM"),
                  "rss": memory(proc.pid), "sampled": sampler.peak()}  # fmt: skip
        pathlib.Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        beats = Every(heartbeat(cls[learners], generations[0]))
        rounds_from = time.time()
        beats.start()
        starts = push_rounds(cls[:learners], generations, push, args.rounds)
        beats.stop.set()
        beats.join()
        end = time.time()
        if beats.errors:
            raise RuntimeError(f"heartbeats failed: {beats.errors[0]}")
        hwm = memory(proc.pid, "VmHWM")
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
            "beats": beats.got, "tape": [e for e in tape if e["event"] in ("pushed", "closed")],
            "end": end, "rss_trace": sampler.got}  # fmt: skip


def rounds_of(raw: dict) -> list[list[float]]:
    """Each round's times: its first push's call, its last push in (the close starts), the ends
    of the merge, the outer step and the checkpoint (the tape's seconds), the close's end (its
    ``closed`` event), the next round's first push (or the end)."""
    closed = {e["closed"]: e for e in raw["tape"] if e["event"] == "closed"}
    out = []
    for r, starts in enumerate(raw["starts"]):
        e = closed[r]
        last = max(x["time"] for x in raw["tape"] if x["event"] == "pushed" and x["round"] == r)
        close = np.cumsum([last, e["merge_s"], e["step_s"], e["checkpoint_s"]]).tolist()
        after = min(raw["starts"][r + 1]) if r + 1 < len(raw["starts"]) else raw["end"]
        out.append([min(starts), *close, e["time"], after])
    return out


def summary(raw: dict) -> dict:
    """The reported numbers of one configuration's raw measurements."""
    times = rounds_of(raw)
    steady = np.array(times[1:] or times)
    merge, step, ckpt, rest = (np.diff(steady, axis=1)[:, 1:5]).mean(axis=0).tolist()
    ingest = [raw["learners"] * raw["model_bytes"] / 1e6 / (t[1] - t[0]) for t in times]
    lat = np.array([s for _, s in raw["beats"]] or [0.0])
    by_phase = phases(raw, times)
    peak = max(raw["join"]["hwm"], raw["join"]["sampled"], raw["rounds_hwm"],
               raw["rounds_sampled"])  # fmt: skip
    return {"params": raw["params"], "learners": raw["learners"],
            "model_gb": raw["model_bytes"] / 1e9, "peak_rss_gb": peak / 1e9,
            "x_model": peak / raw["model_bytes"], "join_peak_gb": raw["join"]["hwm"] / 1e9,
            "rounds_peak_gb": max(raw["rounds_hwm"], raw["rounds_sampled"]) / 1e9,
            "close_s": merge + step + ckpt + rest, "merge_s": merge, "step_s": step,
            "checkpoint_s": ckpt, "rest_s": rest, "ingest_mb_s": float(np.mean(ingest)),
            "ingest_rounds": ingest, "join_s": raw["join"]["s"],
            "heartbeat_max_s": float(lat.max()), "heartbeat_p99_s": float(np.quantile(lat, 0.99)),
            "heartbeats": len(raw["beats"]), "after_joins_gb": raw["join"]["rss"] / 1e9,
            "heartbeats_in_checkpoint": by_phase["checkpoint"]["heartbeats"],
            "heartbeat_checkpoint_max_s": by_phase["checkpoint"]["heartbeat_ms"] / 1e3,
            "phases": by_phase}  # fmt: skip


def phases(raw: dict, times: list[list[float]]) -> dict:
    """Per phase of the rounds (:data:`PHASES`, between the times of :func:`rounds_of`), the
    syncer's sampled peak RSS (GB) and the heartbeats' count and max (ms)."""
    out = {}
    for i, p in enumerate(PHASES):
        within = [(t[i], t[i + 1]) for t in times]
        rss = [b for t, b in raw["rss_trace"] if any(a <= t <= z for a, z in within)]
        beats = [s for t, s in raw["beats"] if any(t < z and t + s > a for a, z in within)]
        out[p] = {"rss_gb": max(rss, default=0) / 1e9, "heartbeats": len(beats),
                  "heartbeat_ms": max(beats, default=float("nan")) * 1e3}  # fmt: skip
    return out


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
             "| close s (merge + step + ckpt + rest) | ingest MB/s | heartbeat max / p99 ms | "
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
            f"{r['step_s']:.2f} + {r['checkpoint_s']:.2f} + {r['rest_s']:.2f}) | "
            f"{r['ingest_mb_s']:.0f} | "
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
    return "\n".join(lines + phase_table(rows))


def phase_table(rows: list[dict]) -> list[str]:
    lines = ["", "Where it goes: the syncer's sampled peak RSS (GB) / the heartbeats' max (ms) "
             "in each phase of the rounds (all rounds)", "",
             "| params | learners | after joins GB | " + " | ".join(PHASES) + " |",
             "|" + "---|" * (3 + len(PHASES))]  # fmt: skip
    for r in rows:
        cells = [f"{r['phases'][p]['rss_gb']:.2f} / {r['phases'][p]['heartbeat_ms']:.0f}"
                 .replace("0.00 /", "- /").replace("nan", "-") for p in PHASES]  # fmt: skip
        lines.append(f"| {r['params'] / 1e6:g} M | {r['learners']} | "
                     f"{r['after_joins_gb']:.2f} | " + " | ".join(cells) + " |")  # fmt: skip
    return lines


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="25e6,100e6", help="model sizes (comma list)")
    parser.add_argument("--learners", default="1,4,8,16", help="learner counts (comma list)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--leaves", type=int, default=4, help="equal float32 leaves")
    parser.add_argument("--join_anchor", choices=("first", "all"), default="first",
                        help="who joins with an anchor (all: as the real learner)")  # fmt: skip
    parser.add_argument("--out", default="runs/bench_syncer/results",
                        help="writes OUT.json and OUT.md")  # fmt: skip
    return parser.parse_args(argv)


def machine_line() -> str:
    """The CPU, its cores, the commit (and whether the package differs from it), the command."""

    def git(*words: str) -> str:
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True).stdout

    commit = git("rev-parse", "--short", "HEAD").strip()
    changed = ", ".join(x[3:] for x in git("status", "--porcelain", "diloco_jax").splitlines())
    commit += f" (uncommitted changes: {changed})" if changed else ""
    return (f"{cpu_name()}, {os.cpu_count()} cores, commit {commit}; "
            f"`{' '.join(['python', 'scripts/bench_syncer.py', *sys.argv[1:]])}`")  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        return serve(*sys.argv[2:4], int(sys.argv[4]))
    args, machine = arguments(), machine_line()
    sizes = [int(float(p)) for p in args.params.split(",")]
    counts = [int(n) for n in args.learners.split(",")]
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench_syncer_certs_"))
    certs.make(folder, max(counts), certs.DEFAULT_HOSTS, log=lambda _: None)
    raws, rows = [], []
    for params in sizes:
        for learners in counts:
            raws.append(run_config(args, folder, params, learners))
            rows.append(summary(raws[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
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
