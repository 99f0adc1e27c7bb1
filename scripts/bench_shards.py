"""Benchmark: a sharded syncer (``syncer.shards``, issue 62) against one syncer, over the real
gRPC service on localhost with TLS.

    uv run python scripts/bench_shards.py [--params 25e6] [--learners 2,4,8] [--shards 1,N]
        [--rounds 3] [--leaves 16] [--out runs/bench_shards/results]

For each learner count N and shard count S (``N``: as many shards as learners), S syncer
processes of plain DiLoCo (float32 pushes, whole leaves: ``--leaves`` equal ones), shard 0
deciding every round and the others asking it how each closed, as the command's followers do
(:mod:`diloco_jax.learners.following`). The learners are threads of this process; each pushes
its part to every shard at once (a thread per shard, the push's chunks made as gRPC sends them
and the answer checked and dropped: nothing held but the push), every round together.

Reported per (N, S): the round's turnaround (from the first push's call to the last learner's
last answer; the median of the rounds after the first, which compiles the outer step); the
bytes through the busiest syncer process per round, in and out, over the model's bytes; the
largest shard's peak RSS (VmHWM, its start and the joins included); the largest shard's peak
under ``incoming/`` (pushes waiting for their round), over learners x model / S. On a machine
of few cores the processes share them, so the turnaround says little about a cluster, where
each shard has its own host and NIC; the bytes through the busiest process are what a shard's
NIC carries there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np
from bench_command import cpu_name  # scripts/: this script's own folder
from bench_syncer import Every, memory

from diloco_jax.learners import certs, identity, service, shards, wire

ROOT = pathlib.Path(__file__).resolve().parent.parent


def serve(folder: str, workdir: str, learners: int, count: int, k: int, leader: str) -> None:
    """``--serve``: shard ``k`` of ``count`` on 127.0.0.1 (a free port, printed), following
    shard 0 at ``leader`` unless it is shard 0, until stdin closes."""
    import optax

    from diloco_jax.algorithm import diloco
    from diloco_jax.learners import following
    from diloco_jax.learners.syncer import Syncer

    service.tune_malloc()  # as python -m diloco_jax.syncer does
    algorithm = diloco(optax.adamw(1e-3), optax.sgd(0.7, momentum=0.9, nesterov=True),
                       sync_every=10)  # fmt: skip
    syncer = Syncer(algorithm, pathlib.Path(workdir), keys={}, learners=learners, timeout=600,
                    dead_after=600, decides=k == 0)  # fmt: skip
    mine = pathlib.Path(folder) / ("syncer" if k == 0 else f"shard_{k}")
    tls, secret = certs.read(mine), certs.token(mine)
    server = service.Server(syncer, "127.0.0.1", 0, secret=secret, tls=tls,
                            shards=count).start()  # fmt: skip
    if k:
        client = service.Client(leader, identity.shard_credential(secret, k), tls=tls,
                                timeout=60)  # fmt: skip
        server.follower = following.Follower(syncer, client, k).start()
    print(server.port, flush=True)
    os.dup2(2, 1)  # anything else said goes to stderr: nobody reads the pipe after the port
    sys.stdin.read()
    server.stop()
    syncer.close()


def start_shard(folder: pathlib.Path, workdir: pathlib.Path, learners: int, count: int, k: int,
                leader: str = "") -> tuple[subprocess.Popen, str]:  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(folder), str(workdir),
                             str(learners), str(count), str(k), leader or "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT,
                            text=True)  # fmt: skip
    assert proc.stdout is not None
    port = proc.stdout.readline().strip()
    if not port:
        raise RuntimeError(f"shard {k} did not start (exit {proc.wait()})")
    return proc, f"127.0.0.1:{port}"


def call(client: service.Client, name: str, fields: dict, arrays: dict) -> tuple[dict, int, int]:
    """One call without holding its answer: ``(reply fields, bytes sent, bytes received)``."""
    sent = [0]

    def chunks():
        for chunk in wire.encode(fields, arrays):
            sent[0] += len(chunk)
            yield chunk

    got = [0]
    replies = client._calls[name](chunks(), metadata=client._metadata, timeout=client.timeout)
    it = iter(replies)

    def counted():
        for chunk in it:
            got[0] += len(chunk)
            yield chunk

    stream = counted()
    header = wire.read_header(stream, client.max_bytes)
    wire.read_data(stream, header, lambda _: None)
    return header.fields, sent[0], got[0]


def wired(args, addresses: list[str], learners: int, params: int):
    """``(each learner's address of each shard, the links)``: without ``--link``, the shards'
    own addresses; with it, every party behind a link of its own (:class:`sim.link.Link`): a
    shard's link carries all its connections, and learner I's connections to the S shards
    share one pair of shapers (its NIC) before reaching the shard's link. The bandwidth is
    scaled by this model's bytes over ``--link_params``' (a transfer of the model takes the
    time it would take the larger one), the latency is the link's, on the shard's side."""
    if not args.link:
        return [list(addresses) for _ in range(learners)], []
    from sim import link as link_lib

    bandwidth_text, latency_text = args.link.split(":")
    bandwidth = link_lib.rate(bandwidth_text)
    assert bandwidth is not None
    scaled = bandwidth * (params // args.leaves * args.leaves) / args.link_params
    latency = link_lib.seconds(latency_text)
    links = []
    front = []
    for address in addresses:
        host, port = address.rsplit(":", 1)
        links.append(link_lib.Link((host, int(port)), bandwidth=scaled, latency=latency).start())
        front.append(links[-1].address)
    routes = []
    for _ in range(learners):
        nic = link_lib.Link(("127.0.0.1", 1), bandwidth=scaled)  # its shapers, shared
        mine = []
        for address in front:
            host, port = address.rsplit(":", 1)
            hop = link_lib.Link((host, int(port)), bandwidth=scaled)
            hop.up, hop.down = nic.up, nic.down
            links.append(hop.start())
            mine.append(hop.address)
        routes.append(mine)
    return routes, links


def folder_bytes(path: pathlib.Path) -> int:
    total = 0
    for p in path.iterdir() if path.is_dir() else []:
        try:
            total += p.stat().st_size
        except OSError:
            pass  # removed meanwhile
    return total


def run_config(args, params: int, learners: int, count: int) -> dict:
    """One (learners, shards): the shards started, joined, ``--rounds`` rounds pushed."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench_shards_"))
    certs.make(folder / "certs", learners, certs.DEFAULT_HOSTS, log=lambda _: None, shards=count)
    leaves = max(args.leaves, count)
    size = params // leaves
    push = {f"['w{i:02d}']": np.full(size, 1e-3, np.float32) for i in range(leaves)}
    describe = [[n, list(a.shape), str(a.dtype)] for n, a in push.items()]
    parts = shards.plan(describe, count)
    pieces = shards.split(push, describe, parts)
    procs, addresses = [], []
    try:
        for k in range(count):
            proc, address = start_shard(folder / "certs", folder / f"shard{k}", learners, count, k,
                                        addresses[0] if k else "")  # fmt: skip
            procs.append(proc)
            addresses.append(address)
        secret = certs.token(folder / "certs" / "syncer")
        routes, links = wired(args, addresses, learners, params)
        cls = [[service.Client(a, identity.learner_credential(secret, i), timeout=900,
                               tls=certs.read(folder / "certs" / f"learner_{i}"))
                for a in routes[i]] for i in range(learners)]  # fmt: skip
        pool = concurrent.futures.ThreadPoolExecutor(learners * count + 4)

        def each_shard(i: int, name: str, fields, arrays_of) -> list[tuple[dict, int, int]]:
            futures = [pool.submit(call, cls[i][k], name, fields(k), arrays_of(k))
                       for k in range(count)]  # fmt: skip
            return [f.result() for f in futures]

        zeros = [{n: np.zeros_like(a) for n, a in p.items()} for p in pieces]

        def join(i: int) -> list[int]:
            got = each_shard(i, "Join", lambda k: {
                "learner": i, "keys": {}, "describe": shards.described(describe, parts[k])},
                lambda k: zeros[k])  # fmt: skip
            return [int(f["generation"]) for f, _, _ in got]

        generations = [join(0)]
        with concurrent.futures.ThreadPoolExecutor(learners) as outer:
            generations += list(outer.map(join, range(1, learners)))
        disk = [Every(lambda k=k: folder_bytes(folder / f"shard{k}" / "incoming"))
                for k in range(count)]  # fmt: skip
        for d in disk:
            d.start()
        barrier = threading.Barrier(learners)
        times = [[(0.0, 0.0)] * learners for _ in range(args.rounds)]
        moved = [[[0, 0] for _ in range(count)] for _ in range(args.rounds)]  # in, out
        lock = threading.Lock()

        def learner(i: int) -> None:
            for r in range(args.rounds):
                barrier.wait()
                start, push_id = time.time(), uuid.uuid4().hex
                got = each_shard(i, "Push", lambda k, r=r, push_id=push_id: {
                    "learner": i, "generation": generations[i][k], "round": r, "weight": 1.0,
                    "push": push_id, "finite": True}, lambda k: pieces[k])  # fmt: skip
                times[r][i] = (start, time.time())
                with lock:
                    for k, (f, sent, received) in enumerate(got):
                        assert int(f["round"]) == r + 1, f
                        moved[r][k][0] += sent
                        moved[r][k][1] += received

        with concurrent.futures.ThreadPoolExecutor(learners) as outer:
            list(outer.map(learner, range(learners)))
        for d in disk:
            d.stop.set()
        rss = [memory(p.pid, "VmHWM") for p in procs]
        for row in cls:
            for c in row:
                c.close()
        pool.shutdown()
        for link in links:
            link.stop()
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)
    model = params // leaves * leaves * 4
    turn = [max(e for _, e in r) - min(s for s, _ in r) for r in times]
    return {
        "params": params, "learners": learners, "shards": count, "model_bytes": model,
        "link": args.link, "link_params": args.link_params if args.link else None,
        "turnaround_s": turn, "turnaround_median_s": statistics.median(turn[1:] or turn),
        "busiest_in_x_model": max(k[0] for r in moved for k in r) / model,
        "busiest_out_x_model": max(k[1] for r in moved for k in r) / model,
        "peak_rss_gb": max(rss) / 1e9,
        "incoming_peak_x_share": max(d.peak() for d in disk) / (learners * model / count),
        "share": max(sum(a.nbytes for a in p.values()) for p in pieces) / model,
    }  # fmt: skip


def predict(args, row: dict, loopback_s: float, rounds: int = 6) -> float:
    """The replay's round (``sim/replay.py``, every party behind a link of its own:
    :class:`sim.replay.Nics`) for ``row``'s learners and shards: each round its pushes flow up
    at once, the round closes, and ``loopback_s`` (the same configuration's round on loopback:
    the pushes' way in, the merge, the outer step, the checkpoint, the answers' way out, with
    no link) later the answers flow down. The followers reach shard 0 on loopback here, so
    they hear how a round closed at once. The median of the rounds after the first."""
    from diloco_jax import config as config_lib
    from sim import link as link_lib
    from sim import replay

    bandwidth_text, latency_text = args.link.split(":")
    bandwidth = link_lib.rate(bandwidth_text)
    assert bandwidth is not None
    n, h, batch = row["learners"], 10, 8
    cfg = config_lib.load_preset("tiny")
    keys = {"outer.sync_every": h, "data.batch_size": batch, "parallel.replicas": 1,
            "syncer.learners": n, "syncer.examples": n * rounds * h * batch}  # fmt: skip
    for key, value in keys.items():
        cfg = config_lib.override(cfg, key, str(value))
    nics = replay.Nics(bandwidth=bandwidth * row["model_bytes"] / 4 / args.link_params,
                       latency=link_lib.seconds(latency_text), up_bytes=row["model_bytes"],
                       down_bytes=row["model_bytes"], shards=row["shards"], share=row["share"],
                       follow_s=0.0)  # fmt: skip
    pace = replay.Pace(step_s=(0.0,) * n, startup_s=0.0, compile_s=0.0, transfer_s=loopback_s,
                       tail_s=0.0, nics=nics)  # fmt: skip
    closes = [e["time"] for e in replay.replay(cfg, pace).tape if e["event"] == "closed"]
    return statistics.median(np.diff(closes)[1:])


def projections(rows: list[dict], params: float = 1e9) -> list[dict]:
    """For each shard count at the most learners measured with three sizes or more: the
    largest shard's peak RSS and the round, fitted ``a + b * model_bytes`` (least squares) over
    those sizes and taken at ``params`` parameters. Two sizes are refused: their line runs
    through both points, so a start-up cost that is not linear in the model (the imports, the
    first compile) tilts it, and the slope it extrapolates is overstated."""
    most = max(r["learners"] for r in rows)
    out = []
    for count in sorted({r["shards"] for r in rows if r["learners"] == most}):
        at = [r for r in rows if r["learners"] == most and r["shards"] == count]
        if len({r["params"] for r in at}) < 3:
            continue
        x = np.array([r["model_bytes"] / 1e9 for r in at])
        rss = np.polyfit(x, [r["peak_rss_gb"] for r in at], 1)
        turn = np.polyfit(x, [r["turnaround_median_s"] for r in at], 1)
        gb = params * 4 / 1e9
        out.append({"params": int(params), "learners": most, "shards": count,
                    "model_gb": gb, "rss_fit": [float(v) for v in rss],
                    "turnaround_fit": [float(v) for v in turn],
                    "peak_rss_gb": float(np.polyval(rss, gb)),
                    "turnaround_s": float(np.polyval(turn, gb)),
                    "sizes": sorted({r["params"] for r in at})})  # fmt: skip
    return out


def table(rows: list[dict], machine: str) -> str:
    link = rows[0]["link"] if rows else ""
    scaled = (
        (
            f"Every party behind its own {link} link, its bandwidth scaled to a "
            f"{rows[0]['link_params'] / 1e6:g} M-parameter model. "
        )
        if link
        else ""
    )
    extra = " loopback round (s) | replay (s) | replay's error |" if link else ""
    lines = [f"Machine: {machine}", "", *([scaled, ""] if scaled else []),
             "| params | learners | shards | round (s, median) | busiest process in / out "
             "(x model) | largest shard's peak RSS (GB) | incoming/ peak (x learners x "
             "model / S) |" + extra, "|---" * (10 if link else 7) + "|"]  # fmt: skip
    for r in rows:
        error = r["replay_s"] / r["turnaround_median_s"] - 1 if link else 0.0
        more = f" {r['loopback_s']:.2f} | {r['replay_s']:.2f} | {error:+.1%} |" if link else ""
        lines.append(f"| {r['params'] / 1e6:g} M | {r['learners']} | {r['shards']} | "
                     f"{r['turnaround_median_s']:.2f} | {r['busiest_in_x_model']:.2f} / "
                     f"{r['busiest_out_x_model']:.2f} | {r['peak_rss_gb']:.2f} | "
                     f"{r['incoming_peak_x_share']:.2f} |" + more)  # fmt: skip
    fits = projections(rows)
    for f in fits:
        lines.append(f"| {f['params'] / 1e9:g} B (projection) | {f['learners']} | "
                     f"{f['shards']} | {f['turnaround_s']:.1f} | | {f['peak_rss_gb']:.2f} "
                     "| |")  # fmt: skip
    if fits:
        sizes = ", ".join(f"{p / 1e6:g} M" for p in fits[0]["sizes"])
        lines += ["", "The projection rows are not measurements: least-squares lines of the "
                  "largest shard's peak RSS and the round against the model's bytes, over "
                  f"{sizes}, taken at 1 B parameters."]  # fmt: skip
    return "\n".join(lines)


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="25e6", help="model sizes (comma list)")
    parser.add_argument("--learners", default="2,4,8", help="learner counts (comma list)")
    parser.add_argument("--shards", default="1,N", help="shard counts (comma list; N: learners)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--leaves", type=int, default=16, help="equal float32 leaves")
    parser.add_argument("--link", default="",
                        help="BANDWIDTH:LATENCY (e.g. 1gbit:20ms): every party behind a link "
                        "of its own (sim/link.py), scaled to --link_params")  # fmt: skip
    parser.add_argument("--link_params", type=float, default=100e6,
                        help="the model size the link's bandwidth is meant for")  # fmt: skip
    parser.add_argument("--out", default="runs/bench_shards/results",
                        help="writes OUT.json and OUT.md")  # fmt: skip
    return parser.parse_args(argv)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        folder, workdir, learners, count, k, leader = sys.argv[2:8]
        return serve(folder, workdir, int(learners), int(count), int(k), leader)
    args = arguments()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    machine = (f"{cpu_name()}, {os.cpu_count()} cores, commit {commit}; "
               f"`python scripts/bench_shards.py {' '.join(sys.argv[1:])}`")  # fmt: skip
    rows = []
    for params in (int(float(p)) for p in args.params.split(",")):
        for learners in (int(n) for n in args.learners.split(",")):
            counts = dict.fromkeys(learners if s == "N" else int(s)
                                   for s in args.shards.split(","))  # fmt: skip
            for count in counts:
                row = run_config(args, params, learners, count)
                if args.link:  # the same on loopback: the replay's time to answer
                    bare = run_config(argparse.Namespace(**{**vars(args), "link": ""}), params,
                                      learners, count)  # fmt: skip
                    row["loopback_s"] = bare["turnaround_median_s"]
                    row["replay_s"] = predict(args, row, bare["turnaround_median_s"])
                rows.append(row)
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    text = table(rows, machine)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows,
                                                   "projections": projections(rows)}))  # fmt: skip


if __name__ == "__main__":
    main()
