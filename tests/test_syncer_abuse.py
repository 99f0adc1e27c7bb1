"""The syncer under abuse (issue 60), tried as an attacker would: floods of wrong credentials,
calls with a stolen credential that never end, pushes whose numbers are out of range, a first
join that claims gigabytes, ids and names made to forge log lines, a second syncer on the port,
plain HTTP on the gRPC port, and a model of another width. Each test names the finding it
covers; each fails on the code before the fix (a worker slept per wrong credential, a caller
could hold all 64 workers, a weight was never checked)."""

import json
import logging
import threading
import time

import chex
import numpy as np
import pytest

from diloco_jax.learners import guard, identity, service, wire
from diloco_jax.learners.syncer import Refused
from tests.test_learners import _algorithm, _ones, _syncer

KEYS = {"outer.sync_every": 3}
X = {"w": np.zeros(3, np.float32)}
JOIN = {"describe": wire.describe(X), "keys": KEYS, "replicas": 2, "rows": 12}  # capacity 24


def _served(tmp_path, learners=2, **kw):
    syncer = _syncer(tmp_path, _algorithm(), learners=learners)
    server = service.Server(syncer, "127.0.0.1", 0, secret="s", **kw).start()
    return syncer, server, f"127.0.0.1:{server.port}"


def _raw(address: str, learner: int | None, method: str, messages, timeout=None):
    """A call of ``method`` whose request stream is ``messages`` (a generator the test
    controls), with learner ``learner``'s credential (None: a wrong one); its reply iterator."""
    grpc = service._grpc()
    channel = grpc.insecure_channel(address)
    credential = (
        "learner.0.forged" if learner is None else identity.learner_credential("s", learner)
    )
    call = channel.stream_stream(f"/{service.SERVICE}/{method}")
    return call(messages, metadata=(("authorization", f"Bearer {credential}"),), timeout=timeout)


def _hold(fields: dict | None, release: threading.Event, leaves=(), size=0, chunks=0):
    """A request that sends its header (None: none) and ``chunks`` zero chunks, then nothing
    until ``release`` is set."""
    if fields is None:
        release.wait(60)
        return
    yield json.dumps({"fields": fields, "leaves": list(leaves), "bytes": size,
                      "sha256": ""}).encode()  # fmt: skip
    for _ in range(chunks):
        yield bytes(wire.CHUNK)
    release.wait(60)


def _code(call) -> str:
    grpc = service._grpc()
    try:
        list(call)
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def test_calls_that_never_end_hold_one_lane_of_their_learner_and_are_cancelled_when_idle(tmp_path):
    """Finding 2: 70 heartbeats with learner 0's own credential that never send their header.
    One takes learner 0's heartbeat lane, the 69 others are refused at once
    (``RESOURCE_EXHAUSTED``); learner 1 keeps its lanes and is answered; the held call is
    cancelled once idle for the watchdog's limit (3 s here: all 70 are in by then, even on a
    loaded machine), and the lane is free again."""
    syncer, server, address = _served(tmp_path, idle=3.0)
    release = threading.Event()
    honest = service.Client(address, identity.learner_credential("s", 1), timeout=5)
    try:
        syncer.join(0, wire.describe(X), KEYS, wire.named(X))
        syncer.join(1, wire.describe(X), KEYS, wire.named(X))
        calls = [_raw(address, 0, "Heartbeat", _hold(None, release)) for _ in range(70)]
        done: list[str] = []
        threads = [threading.Thread(target=lambda c=c: done.append(_code(c))) for c in calls]
        for t in threads:
            t.start()
        # learner 1's heartbeat, its deadline 5 s: the 64 workers of old were all held
        assert honest.call("Heartbeat", {"learner": 1, "generation": 1})[0]["round"] == 0
        for t in threads:
            t.join(30)
        assert sorted(done) == ["CANCELLED"] + ["RESOURCE_EXHAUSTED"] * 69
        deadline = time.monotonic() + 5  # the lane is given back as the call ends, server-side
        while server.lanes.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.watchdog.cancelled == 1 and server.lanes.busy == {}
    finally:
        release.set()
        honest.close()
        server.stop()
        syncer.close()


def test_a_flood_of_wrong_credentials_holds_no_worker(tmp_path, caplog):
    """Finding 1: 400 wrong-credential calls in flight at once (each one a worker of old, asleep
    for up to 2 s: 64 workers, minutes of queue); each refused ``UNAUTHENTICATED`` at once, so
    learner 0's heartbeats in the middle of the flood are answered within their 5 s deadline,
    and the log holds counted lines (1, 2, 4, ..., 256), not one a call."""
    syncer, server, address = _served(tmp_path)
    honest = service.Client(address, identity.learner_credential("s", 0), timeout=5)
    try:
        syncer.join(0, wire.describe(X), KEYS, wire.named(X))
        with caplog.at_level(logging.WARNING, "diloco_jax"):
            flood = [_raw(address, None, "Heartbeat", iter([b"{}"])) for _ in range(400)]
            for _ in range(3):
                assert honest.call("Heartbeat", {"learner": 0, "generation": 1})[0]["round"] == 0
            codes = [_code(call) for call in flood]
    finally:
        honest.close()
        server.stop()
        syncer.close()
    assert codes == ["UNAUTHENTICATED"] * 400
    # each record once (pytest's handler may sit on this logger as well as on the root)
    lines = dict.fromkeys(r for r in caplog.records if "failed authentication" in r.getMessage())
    assert len(lines) == 9  # 1, 2, 4, ..., 256 of 400
    assert syncer.members[0].status == "present"


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), -1.0])
def test_a_push_whose_weight_is_no_number_of_examples_is_refused(tmp_path, weight):
    """Finding 3: weights Infinity, NaN and -1: refused at the header over gRPC (nothing
    read, nothing pending), and by the syncer itself (``admit``), with a ``refused`` event;
    the anchor, the round and the examples budget unchanged. Weight 24 (the capacity the
    learner's join declared: 2 replicas x 12 rows) then goes through. (A weight above the
    capacity is capped: tests/test_syncer_robust.py.)"""
    syncer, server, address = _served(tmp_path, learners=1)
    client = service.Client(address, identity.learner_credential("s", 0), timeout=10)
    fields = {"learner": 0, "generation": 1, "round": 0, "weight": weight, "push": "w1"}
    try:
        client.call("Join", {**JOIN, "learner": 0}, wire.named(X))
        before = [np.asarray(a).copy() for a in syncer.anchor]
        with pytest.raises(service.RefusedBySyncer, match="weight"):
            client.call("Push", fields, _ones(1.0))
        with pytest.raises(Refused, match="weight"):
            syncer.push(0, 1, 0, weight, _ones(1.0), push_id="w2")
        assert syncer.pending == {} and syncer.ledger.receiving == {} and syncer.round == 0
        assert syncer.merged == 0.0
        chex.assert_trees_all_equal([np.asarray(a) for a in syncer.anchor], before)
        assert not any(syncer.incoming.iterdir())
        reply, _ = client.call("Push", {**fields, "weight": 24.0, "push": "w3"}, _ones(1.0))
        assert reply["round"] == 1 and syncer.merged == 24.0
    finally:
        client.close()
        server.stop()
        syncer.close()
    refused = [json.loads(x) for x in (tmp_path / "syncer" / "syncer.jsonl").open()]
    assert sum(e["event"] == "refused" and e.get("reason") == "weight" for e in refused) >= 1


def test_a_push_of_weight_zero_is_left_out_and_its_capacity_survives_a_restart(tmp_path):
    """Weight 0 is what an honest learner pushes when none of its replicas' pseudo-gradients
    was finite: it closes its round without moving the anchor or counting examples. The
    capacity a join declared is in the round's checkpoint: a restarted syncer still caps a
    push of 10x it to it."""
    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    syncer.join(0, wire.describe(X), KEYS, wire.named(X), capacity=24.0)
    assert syncer.push(0, 1, 0, 0.0, _ones(1.0), push_id="zero") == 0
    syncer.tick()
    assert syncer.round == 1 and syncer.merged == 0.0
    np.testing.assert_array_equal(np.asarray(syncer.anchor[0]), np.zeros(3, np.float32))
    syncer.close()
    again = _syncer(tmp_path, _algorithm(), learners=1)
    try:
        assert again.round == 1 and again.capacity == {0: 24.0}
        again.push(0, 1, 1, 240.0, _ones(1.0), push_id="big")
        again.tick()
        assert again.round == 2 and again.merged == 24.0 and again.members[0].capped == 1
    finally:
        again.close()


def test_push_ids_and_fields_out_of_range_are_refused_in_one_line_without_forged_lines(
    tmp_path, caplog
):
    """Finding 7: push ids with ``/``, NUL, a newline, 65 characters, or not a string, and a
    round that is a float, are refused ``INVALID_ARGUMENT`` naming the field (never an internal
    error); a leaf name with a newline is refused too, and no log line holds a raw newline (an
    event's text, which the checks above keep clean, is escaped in the log all the same)."""
    syncer, server, address = _served(tmp_path, learners=1)
    client = service.Client(address, identity.learner_credential("s", 0), timeout=10)
    base = {"learner": 0, "generation": 1, "round": 0, "weight": 1.0}
    try:
        syncer.join(0, wire.describe(X), KEYS, wire.named(X))
        with caplog.at_level(logging.INFO, "diloco_jax"):
            for bad in ("a/b", "a\x00b", "x\n03:00:00 syncer: forged", "p" * 65, 7):
                with pytest.raises(service.RefusedBySyncer, match="push id"):
                    client.call("Push", {**base, "push": bad}, _ones(1.0))
            with pytest.raises(service.RefusedBySyncer, match="round must be an integer"):
                client.call("Push", {**base, "push": "ok", "round": 0.5}, _ones(1.0))
            with pytest.raises(service.RefusedBySyncer, match="lacks"):
                client.call("Push", {**base, "push": "ok"}, {"w\nforged": np.ones(3, np.float32)})
            syncer.event("refused", reason="a caller's\n03:00:00 syncer: forged")
        assert syncer.pending == {} and server.errors == 0
        assert not any("\n" in r.getMessage() for r in caplog.records)
        assert any("a caller's\\n03:00:00" in r.getMessage() for r in caplog.records)
    finally:
        client.close()
        server.stop()
        syncer.close()


def test_a_first_join_claiming_gigabytes_allocates_nothing_and_blocks_no_other_join(tmp_path):
    """Finding 6: learner 0's first join declares a 2 GiB anchor, sends 2 MiB of it and
    stalls. Its bytes go to a file as they come (2 MiB on disk, never 2 GB in memory), and
    learner 1's join meanwhile brings the anchor and is answered. Learner 0's join, once its
    stream ends short, is refused."""
    syncer, server, address = _served(tmp_path)
    release = threading.Event()
    big = [["['w']", [1 << 29], "float32"]]
    fields = {"learner": 0, "describe": big, "keys": KEYS}
    stalled = _raw(address, 0, "Join", _hold(fields, release, big, 1 << 31, chunks=2))
    codes: list[str] = []
    worker = threading.Thread(target=lambda: codes.append(_code(stalled)))
    worker.start()
    other = service.Client(address, identity.learner_credential("s", 1), timeout=10)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not list(syncer.incoming.glob("join-*")):
            time.sleep(0.05)
        files = list(syncer.incoming.glob("join-*"))
        assert len(files) == 1
        reply, anchor = other.call("Join", {**JOIN, "learner": 1}, wire.named(X))
        assert reply["generation"] == 1 and list(anchor) == ["['w']"]
        assert files[0].stat().st_size <= 2 * wire.CHUNK
    finally:
        release.set()
        worker.join(30)
        other.close()
        server.stop()
        syncer.close()
    assert codes == ["INVALID_ARGUMENT"] and 0 not in syncer.members
    assert not list(syncer.incoming.glob("join-*"))


def test_a_learner_of_another_width_is_refused_naming_its_first_differing_leaf(tmp_path):
    """Finding 11: a model of another width is refused by its leaf and shapes, not by the size
    of its message (the description is compared before any size limit)."""
    syncer, server, address = _served(tmp_path)
    wide = {"w": np.zeros(5, np.float32)}
    client = service.Client(address, identity.learner_credential("s", 1), timeout=10)
    try:
        syncer.join(0, wire.describe(X), KEYS, wire.named(X))
        named = r"parameter \['w'\] is \[5\] float32, expected \[3\] float32"
        with pytest.raises(service.RefusedBySyncer, match=named):
            client.call("Join", {**JOIN, "learner": 1, "describe": wire.describe(wide)},
                        wire.named(wide))  # fmt: skip
    finally:
        client.close()
        server.stop()
        syncer.close()


def test_one_syncer_per_port_and_plain_http_on_it_writes_no_traceback(tmp_path, capfd):
    """Findings 8 and 9: a second syncer on a port taken is refused in one line (gRPC's
    SO_REUSEPORT would have split the learners between the two), not in gRPC's C core's; a
    plain-HTTP request to the TLS port is refused without a traceback or a line of the C
    core's, and learners are served after it."""
    import socket

    from diloco_jax.learners import certs
    from tests.test_syncer_security import _credentials

    folder, secret = _credentials(tmp_path, 1)
    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    server = service.Server(syncer, "127.0.0.1", 0, secret=secret,
                            tls=certs.read(folder / "syncer")).start()  # fmt: skip
    client = service.Client(f"localhost:{server.port}", identity.learner_credential(secret, 0),
                            timeout=10, tls=certs.read(folder / "learner_0"))  # fmt: skip
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}: the port "
                           "is taken"):  # fmt: skip
            service.Server(syncer, "127.0.0.1", server.port, secret=secret)
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: syncer\r\n\r\n")
            s.settimeout(5)
            assert s.recv(200) == b""  # the handshake fails: closed, nothing answered
        reply, _ = client.call("Join", {**JOIN, "learner": 0}, wire.named(X))
        assert reply["generation"] == 1
    finally:
        client.close()
        server.stop()
        syncer.close()
    err = capfd.readouterr().err  # neither a traceback nor gRPC's C core's lines
    assert "Traceback" not in err and "Handshake failed" not in err and "add_port" not in err


def test_a_stalled_push_is_cancelled_its_slot_freed_and_a_retry_merged_once(tmp_path):
    """A push that sends its header and stalls holds its learner's slot only until the
    watchdog cancels it (idle 1 s here); the learner's retry of the same id is then admitted
    and merged, once."""
    syncer, server, address = _served(tmp_path, learners=1, idle=1.0)
    release = threading.Event()
    fields = {"learner": 0, "generation": 1, "round": 0, "weight": 1.0, "push": "same"}
    client = service.Client(address, identity.learner_credential("s", 0), timeout=10)
    try:
        syncer.join(0, wire.describe(X), KEYS, wire.named(X))
        leaves = [["['w']", [3], "float32"]]
        stalled = _raw(address, 0, "Push", _hold(fields, release, leaves, 12))
        assert _code(stalled) == "CANCELLED" and server.watchdog.cancelled == 1
        deadline = time.monotonic() + 10  # the handler sees the cancel and gives the slot up
        while syncer.ledger.receiving and time.monotonic() < deadline:
            time.sleep(0.05)
        assert syncer.ledger.receiving == {} and server.lanes.busy.get(
            (identity.Identity("learner", 0), "Push"), 0) <= 1  # fmt: skip
        reply, _ = client.call("Push", fields, _ones(1.0))
        assert reply["round"] == 1 and not reply["again"] and syncer.merged == 1.0
    finally:
        release.set()
        client.close()
        server.stop()
        syncer.close()


def test_guard_fields_and_lanes_by_definition():
    """The header checks and the lanes alone: each field's range, and a lane taken back."""
    ok = {"generation": 1, "round": 2, "weight": 3.5, "push": "a-B_9", "holds": -1}
    assert guard.push_fields(ok) == (1, 2, 3.5, "a-B_9", -1)
    bad_fields = ({"generation": True}, {"round": -1}, {"round": 1 << 41}, {"weight": "1"},
                  {"weight": float("nan")}, {"weight": -0.5}, {"push": ""},
                  {"holds": 1.0})  # fmt: skip
    for bad in bad_fields:
        with pytest.raises(guard.BadField):
            guard.push_fields({**ok, **bad})
    lanes = guard.Lanes()
    assert [lanes.enter("a", "Push") for _ in range(3)] == [True, True, False]
    assert lanes.enter("b", "Push") and lanes.enter("a", "Heartbeat")
    lanes.leave("a", "Push")
    assert lanes.enter("a", "Push") and not lanes.enter("a", "Push")
    each = sum(guard.LANES.values()) - guard.LANES["Decision"]  # a learner's lanes
    assert lanes.workers(8) == guard.SPARE_WORKERS + 8 * each
    assert lanes.workers(8, shards=4) == lanes.workers(8) + 3  # a Decision lane per follower


_FLOOD = """
import sys, threading, grpc
address, credential, stolen, seconds, ca = sys.argv[1:6]
seconds = float(seconds)
def channel():  # with a CA: TLS, no certificate of our own
    if ca == "-":
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(open(ca, "rb").read()))
channels = [channel() for _ in range(20)]  # as from 20 peers' sockets
stop = threading.Event()
def never():  # a request stream that sends nothing
    stop.wait(seconds + 5)
    yield from ()
def flood(channel):
    call = channel.stream_stream("/diloco_jax.Syncer/Heartbeat")
    metadata = (("authorization", "Bearer " + credential),)
    while not stop.is_set():
        calls = [call(iter([b"{}"]), metadata=metadata, timeout=10) for _ in range(75)]
        for c in calls:  # all 75 in flight at once, then their answers taken
            try:
                list(c)
            except grpc.RpcError:
                pass
held = channels[0].stream_stream("/diloco_jax.Syncer/Heartbeat")
holding = [held(never(), metadata=(("authorization", "Bearer " + stolen),)) for _ in range(70)]
threads = [threading.Thread(target=flood, args=(c,), daemon=True) for c in channels]
for t in threads:
    t.start()
print("flooding", flush=True)
stop.wait(seconds)
stop.set()
"""


def _rounds_per_second(address: str, rounds: int, secret: str = "s", folder=None) -> float:
    """Two learners (clients in threads, with their certificates in ``folder``) pushing
    ``rounds`` synchronous rounds; rounds a second."""
    from diloco_jax.learners import certs

    clients = [service.Client(address, identity.learner_credential(secret, i), timeout=30,
                              tls=None if folder is None else certs.read(folder / f"learner_{i}"))
               for i in range(2)]  # fmt: skip

    def learner(i: int) -> None:
        f, _ = clients[i].call("Join", {**JOIN, "learner": i}, wire.named(X))
        rnd = f["round"]
        for _ in range(rounds):
            fields = {"learner": i, "generation": f["generation"], "round": rnd, "weight": 1.0,
                      "push": f"{i}-{rnd}-{time.monotonic_ns()}"}  # fmt: skip
            reply, _ = clients[i].call("Push", fields, _ones(0.01))
            rnd = reply["round"]

    threads = [threading.Thread(target=learner, args=(i,)) for i in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for c in clients:
        c.close()
    return rounds / (time.monotonic() - t0)


@pytest.mark.slow
@pytest.mark.parametrize("mutual, floor", [(False, 0.2), (True, 0.3)])
def test_learners_beside_a_flood_close_rounds_at_a_share_of_their_rate(tmp_path, mutual, floor):
    """Findings 1-2 together, from another process on this machine: 20 channels each keeping
    75 wrong-credential calls in flight (1500), and 70 heartbeats that never end with learner
    0's stolen credential. Two learners' synchronous rounds close at >= ``floor`` x the rate
    they close at without the flood (measured in one run), and learner 0 is never dropped.

    Why two floors: without mutual TLS every flooding call reaches gRPC's Python server, which
    spends about 1 ms of CPU refusing it (~1000 refusals a second on one core here), and the
    flooding process takes one of this machine's two cores. With mutual TLS (the recommended
    setting across networks, and diloco-launch's) a caller without a certificate of the run's
    CA fails in the TLS handshake, in gRPC's C core, never reaching Python; the handshakes
    still cost CPU. The measured ratios, against the issue's target of 0.5x, are in the
    learners guide ("Across the internet"); the floors sit below them, not at the target.
    A line per failed handshake is not written (GRPC_VERBOSITY=ERROR): the log stays short."""
    import subprocess
    import sys

    from diloco_jax.learners import certs
    from tests.test_syncer_security import _credentials

    folder, secret = _credentials(tmp_path) if mutual else (None, "s")
    syncer = _syncer(tmp_path, _algorithm(), learners=2)
    tls = certs.read(folder / "syncer") if mutual else None
    server = service.Server(syncer, "127.0.0.1", 0, secret=secret, tls=tls, mutual=mutual).start()
    address = f"{'localhost' if mutual else '127.0.0.1'}:{server.port}"
    ca = str(folder / "operator" / "ca.pem") if mutual else "-"
    try:
        quiet = _rounds_per_second(address, 30, secret, folder)
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, address, "learner.0.forged",
                                  identity.learner_credential(secret, 0), "120", ca],
                                 stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
            time.sleep(2)  # the flood at full strength
            flooded = _rounds_per_second(address, 30, secret, folder)
        finally:
            flood.kill()
            flood.wait()
    finally:
        server.stop()
        syncer.close()
    print(f"mutual={mutual}: rounds/s quiet {quiet:.2f}, flooded {flooded:.2f} "
          f"({flooded / quiet:.2f}x); {server.failures.total} refused at the syncer")  # fmt: skip
    assert flooded >= floor * quiet
    assert mutual or server.failures.total > 1500  # the flood reached the syncer
    assert all(m.status == "present" for m in syncer.members.values())
