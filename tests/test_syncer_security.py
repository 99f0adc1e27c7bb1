"""Learners and a syncer across networks we do not own (issue 53), tested as an attacker would:
a recording proxy on a TLS channel, one learner's credential used as another's, a push
replayed in its round, after it and after a restart, a forged push for a taken slot, a push of
another dtype or of a size the model cannot have; and a damaged checkpoint, a partition, a
checkpoint written while heartbeats go on."""

import json
import logging
import socket
import threading

import chex
import numpy as np
import pytest

from diloco_jax.learners import certs, identity, service, wire
from diloco_jax.learners.syncer import Refused
from tests.test_learners import _algorithm, _Clock, _ones, _syncer, _tiny

KEYS = {"outer.sync_every": 3}
X = {"w": np.zeros(3, np.float32)}


def _credentials(tmp_path, learners: int = 2):
    """``(folder, secret)`` of a run made by ``diloco-syncer certs``."""
    out = tmp_path / "credentials"
    certs.make(out, learners, list(certs.DEFAULT_HOSTS), log=lambda _: None)
    return out, (out / "ca" / "secret").read_text().strip()


def _tape(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "syncer" / "syncer.jsonl").open()]


def _join_all(syncer, learners: int) -> None:
    for i in range(learners):
        syncer.join(i, wire.describe(X), KEYS, wire.named(X))


class _Proxy:
    """A pass-through TCP proxy on 127.0.0.1 that keeps every byte it forwards, both ways."""

    def __init__(self, port: int):
        self.target, self.chunks, self.lock = port, [], threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # stopped
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    self.chunks.append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def captured(self) -> bytes:
        with self.lock:
            return b"".join(self.chunks)

    def stop(self) -> None:
        self.stopped.set()
        self.listener.close()


def test_a_recording_proxy_sees_neither_the_credential_nor_a_tensor_and_the_learner_trains(
        tmp_path):  # fmt: skip
    """A learner (``train()``, this process) reaches a TLS syncer (mutual: its certificate too)
    through a pass-through proxy that records every byte: it trains what one replica of DiLoCo
    trains, bit for bit, and the capture holds neither its credential, the run's secret nor
    the anchor's bytes that crossed the proxy. The same exchange in clear does show the
    credential: the check can fail."""
    from diloco_jax.learners.command import make_syncer
    from diloco_jax.train import train

    folder, secret = _credentials(tmp_path, 1)
    one = {"parallel.replicas": 1, "parallel.runtime": "sim"}
    want = train(_tiny(**one), tmp_path / "one", show_progress=False)
    syncer = make_syncer(_tiny(**one), tmp_path / "syncer")
    server = service.Server(syncer, "127.0.0.1", 0, secret=secret, mutual=True,
                            tls=certs.read(folder / "syncer")).start()  # fmt: skip
    proxy = _Proxy(server.port)
    try:
        got = train(_tiny(**one, **{"syncer.address": f"127.0.0.1:{proxy.port}",
                                    "syncer.credentials": str(folder / "learner_0")}),
                    tmp_path / "learner", show_progress=False)  # fmt: skip
    finally:
        proxy.stop()
        server.stop()
        syncer.close()
    chex.assert_trees_all_equal(got["state"].anchor, want["state"].anchor)
    captured = proxy.captured()
    anchor = max(syncer.anchor, key=lambda a: a.size)  # the answer of the last round
    assert len(captured) > 2 * anchor.nbytes  # the rounds went through the proxy
    credential = (folder / "learner_0" / "token").read_text().strip()
    assert credential.encode() not in captured and secret.encode() not in captured
    assert anchor.tobytes()[:64] not in captured
    # the control: in clear, the same proxy sees the credential and the tensor
    plain_syncer = _syncer(tmp_path / "plain", _algorithm(), learners=1)
    plain = service.Server(plain_syncer, "127.0.0.1", 0, secret=secret).start()
    proxy = _Proxy(plain.port)
    tensor = {"['w']": np.array([1.25, -7.5, 3.0625], np.float32)}
    client = service.Client(f"127.0.0.1:{proxy.port}", credential, timeout=10)
    try:
        client.call("Join", {"learner": 0, "describe": wire.describe(X), "keys": KEYS},
                    tensor)  # fmt: skip
    finally:
        client.close()
        proxy.stop()
        plain.stop()
        plain_syncer.close()
    assert credential.encode() in proxy.captured()
    assert tensor["['w']"].tobytes() in proxy.captured()


def test_a_learners_credential_acts_only_as_itself(tmp_path):
    """Learner 0's credential, and the operator's, are refused as learner 1 for each of the
    four calls, and change nothing; learner 1's own then joins as generation 1. With mutual
    TLS, learner 0's certificate carrying learner 1's credential is refused too."""
    folder, secret = _credentials(tmp_path)
    syncer = _syncer(tmp_path, _algorithm(), learners=2)
    server = service.Server(syncer, "127.0.0.1", 0, secret=secret, mutual=True,
                            tls=certs.read(folder / "syncer")).start()  # fmt: skip
    address = f"127.0.0.1:{server.port}"
    mine = service.Client(address, identity.learner_credential(secret, 0), timeout=10,
                          tls=certs.read(folder / "learner_0"))  # fmt: skip
    join = ({"learner": 1, "describe": wire.describe(X), "keys": KEYS}, wire.named(X))
    calls = {"Join": join,
             "Push": ({"learner": 1, "generation": 1, "round": 0, "weight": 1.0, "push": "f"},
                      _ones(9.0)),
             "Heartbeat": ({"learner": 1, "generation": 1}, None),
             "Leave": ({"learner": 1, "generation": 1}, None)}  # fmt: skip
    try:
        mine.call("Join", {**join[0], "learner": 0}, join[1])
        before = (dict(syncer.members[0].__dict__), [a.copy() for a in syncer.anchor])
        for name, (fields, arrays) in calls.items():
            with pytest.raises(service.RefusedBySyncer, match="learner 0's: it cannot act as "
                               "learner 1"):  # fmt: skip
                mine.call(name, fields, arrays)
        operator = service.Client(address, identity.operator_credential(secret), timeout=10,
                                  tls=certs.read(folder / "operator"))  # fmt: skip
        with pytest.raises(service.RefusedBySyncer, match="operator's: it cannot act"):
            operator.call("Join", *join)
        operator.close()
        assert list(syncer.members) == [0] and syncer.pending == {}
        assert dict(syncer.members[0].__dict__) == before[0]
        chex.assert_trees_all_equal(syncer.anchor, before[1])
        # learner 0's certificate with learner 1's credential: the names disagree
        swapped = service.Client(address, identity.learner_credential(secret, 1), timeout=10,
                                 tls=certs.read(folder / "learner_0"))  # fmt: skip
        with pytest.raises(service.RefusedBySyncer, match="missing or wrong credential"):
            swapped.call("Join", *join)
        swapped.close()
        honest = service.Client(address, identity.learner_credential(secret, 1), timeout=10,
                                tls=certs.read(folder / "learner_1"))  # fmt: skip
        assert honest.call("Join", *join)[0]["generation"] == 1
        honest.close()
    finally:
        mine.close()
        server.stop()
        syncer.close()
    assert [e["claimed"] for e in _tape(tmp_path) if e["event"] == "impersonation"] == [1] * 5


def test_a_push_is_merged_once_whatever_the_copies_and_a_forged_one_is_refused(tmp_path):
    """Quorum 1 of 2 (no grace to speak of), on a test clock. Learner 0's push ``a`` sent again
    in its round, again after the round closed (it would have been merged late into round 1)
    and again after the syncer restarted: merged once, each copy answered with round 0's
    result. A different push for learner 1's taken slot is refused as a conflict, in the tape,
    and learner 1's honest push is the one merged."""
    clock = _Clock()
    kw = {"learners": 2, "quorum": 1, "grace": 0.01, "adaptive_grace": False, "clock": clock}
    syncer = _syncer(tmp_path, _algorithm(), **kw)
    try:
        _join_all(syncer, 2)
        syncer.push(1, 1, 0, 1.0, _ones(2.0), push_id="b")
        with pytest.raises(Refused, match=r"conflict: learner 1 already pushed for round 0 "
                           r"\(push b\); a different push \(forged\)"):  # fmt: skip
            syncer.push(1, 1, 0, 1.0, _ones(-500.0), push_id="forged")
        assert syncer.push(0, 1, 0, 1.0, _ones(1.0), push_id="a") == 0
        assert syncer.push(0, 1, 0, 1.0, _ones(1.0), push_id="a") == 0  # in its round
        clock.t = 1.0
        syncer.tick()
        assert syncer.round == 1
        assert syncer.push(0, 1, 0, 1.0, _ones(1.0), push_id="a") == 0  # after: not late
        assert syncer.pending == {}
        anchor = syncer.anchor[0].copy()
    finally:
        syncer.close()
    # round 0 merged "a" and "b" once each: -0.7 x 1.9 x mean(1, 2)
    np.testing.assert_allclose(anchor, np.full(3, -0.7 * 1.9 * 1.5), rtol=1e-6)
    again = _syncer(tmp_path, _algorithm(), **kw)  # restarted: the merged ids came back
    try:
        assert again.push(0, 1, 0, 1.0, _ones(1.0), push_id="a") == 0
        assert again.pending == {} and again.round == 1
        np.testing.assert_array_equal(again.anchor[0], anchor)
    finally:
        again.close()
    tape = _tape(tmp_path)
    assert [e.get("push") for e in tape if e["event"] == "pushed"] == ["b", "a"]
    assert [e["refused"] for e in tape if e["event"] == "conflict"] == ["forged"]


def test_over_grpc_a_retried_push_is_answered_again_not_merged_again(tmp_path):
    """The same Push message sent twice (a client whose answer was lost retries): the second is
    answered with the first one's round and anchor, marked ``again``; the anchor moved once."""
    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    server = service.Server(syncer, "127.0.0.1", 0, secret="s").start()
    client = service.Client(f"127.0.0.1:{server.port}", identity.learner_credential("s", 0),
                            timeout=10)  # fmt: skip
    push = ({"learner": 0, "generation": 1, "round": 0, "weight": 1.0, "push": "p"}, _ones(1.0))
    try:
        client.call("Join", {"learner": 0, "describe": wire.describe(X), "keys": KEYS},
                    wire.named(X))  # fmt: skip
        first, anchor = client.call("Push", *push)
        second, again = client.call("Push", *push)
    finally:
        client.close()
        server.stop()
        syncer.close()
    assert (first["round"], first["again"], second["round"], second["again"]) == (1, False, 1, True)
    np.testing.assert_array_equal(anchor["['w']"], again["['w']"])
    np.testing.assert_allclose(again["['w']"], np.full(3, -0.7 * 1.9), rtol=1e-6)
    assert syncer.round == 1


def test_a_push_of_another_dtype_or_size_is_refused_before_its_data_is_read(tmp_path):
    """An int32 push is refused, naming the leaf and dtype, directly and over gRPC, before its
    bytes are read; a push whose header declares 1 GiB for a 3-value model is refused at its
    header: the client's request stream is read no further than a few chunks."""
    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    server = service.Server(syncer, "127.0.0.1", 0, secret="s").start()
    credential = identity.learner_credential("s", 0)
    client = service.Client(f"127.0.0.1:{server.port}", credential, timeout=10)
    fields = {"learner": 0, "generation": 1, "round": 0, "weight": 1.0, "push": "i"}
    try:
        syncer.join(0, wire.describe(X), KEYS, wire.named(X))
        ints = {"['w']": np.ones(3, np.int32)}
        with pytest.raises(Refused, match=r"the push's \['w'\] is int32, expected float32$"):
            syncer.push(0, 1, 0, 1.0, ints, push_id="i")
        with pytest.raises(service.RefusedBySyncer, match=r"\['w'\] is int32"):
            client.call("Push", fields, ints)
        pulled = []

        def giant():
            header = {"fields": fields, "leaves": [["['w']", [1 << 28], "float32"]],
                      "bytes": 1 << 30, "sha256": ""}  # fmt: skip
            yield json.dumps(header).encode()
            for _ in range(1024):
                pulled.append(1)
                yield bytes(wire.CHUNK)

        grpc = service._grpc()
        call = client._channel.stream_stream(f"/{service.SERVICE}/Push")
        with pytest.raises(grpc.RpcError) as refused:
            list(call(giant(), metadata=(("authorization", f"Bearer {credential}"),),
                      timeout=30))  # fmt: skip
        assert "lacks ['w'] [3] or has another shape" in refused.value.details()
        assert len(pulled) < 64  # of 1024 MiB: refused at the header
        assert syncer.pending == {} and syncer.ledger.receiving == {} and syncer.round == 0
        assert not any(syncer.incoming.iterdir())
    finally:
        client.close()
        server.stop()
        syncer.close()


def test_a_damaged_newest_checkpoint_falls_back_to_the_round_before(tmp_path, caplog):
    """Two rounds closed (checkpoints 0, 1, 2); the largest file of checkpoint 2 cut in half:
    a restarted syncer names it in one line and goes on from round 1, with round 1's anchor."""
    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    anchors = []
    try:
        _join_all(syncer, 1)
        for rnd in range(2):
            syncer.push(0, 1, rnd, 1.0, _ones(1.0), push_id=f"p{rnd}")
            anchors.append(syncer.anchor[0].copy())
    finally:
        syncer.close()
    newest = tmp_path / "syncer" / "checkpoints" / "2"
    victim = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, "diloco_jax"):
        again = _syncer(tmp_path, _algorithm(), learners=1)
    try:
        assert again.round == 1
        np.testing.assert_array_equal(again.anchor[0], anchors[0])
    finally:
        again.close()
    lines = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(lines) == 1 and "checkpoints/2 is damaged" in lines[0]


def test_a_partitioned_learner_is_admitted_again_under_a_quorum(tmp_path):
    """Quorum 1 of 2, dead after 5 s, on a test clock: learner 1 is cut off and dropped for
    silence while learner 0 closes round 0 alone; when the link heals, learner 1's push for
    round 0 (1 round late, within ``syncer.max_late``) is admitted again and merged late into
    round 1. Synchronous rounds still refuse a dropped learner's push."""
    clock = _Clock()
    syncer = _syncer(tmp_path, _algorithm(), learners=2, quorum=1, grace=0.01,
                     adaptive_grace=False, dead_after=5.0, clock=clock)  # fmt: skip
    try:
        _join_all(syncer, 2)
        syncer.push(0, 1, 0, 1.0, _ones(1.0), push_id="a0")
        clock.t = 6.0
        syncer.heartbeat(0, 1)  # learner 0 is heard from; learner 1 is silent
        syncer.tick()
        assert syncer.round == 1 and syncer.members[1].status == "dropped"
        assert syncer.push(1, 1, 0, 1.0, _ones(3.0), push_id="b0") == 1
        assert syncer.members[1].status == "present" and syncer.pending[1].late == 1
    finally:
        syncer.close()
    assert [e["learner"] for e in _tape(tmp_path) if e["event"] == "readmitted"] == [1]
    sync = _syncer(tmp_path / "sync", _algorithm(), learners=2, dead_after=5.0, clock=clock)
    try:
        clock.t = 0.0
        _join_all(sync, 2)
        clock.t = 6.0
        sync.tick()
        with pytest.raises(Refused, match="learner 1 was dropped: join again"):
            sync.push(1, 1, 0, 1.0, _ones(3.0), push_id="s")
    finally:
        sync.close()


def test_heartbeats_and_status_are_answered_while_a_round_is_written(tmp_path):
    """A round's checkpoint write is held (a disk that does not answer): the round is closing,
    yet a heartbeat and the status are answered meanwhile, and the new anchor goes out only
    once the write is done."""
    syncer = _syncer(tmp_path, _algorithm(), learners=2)
    written, release = threading.Event(), threading.Event()
    save = syncer._save

    def slow_save(rnd, *args):
        if rnd == 1:
            written.set()
            release.wait(30)
        save(rnd, *args)

    syncer._save = slow_save
    answers = {}
    try:
        _join_all(syncer, 2)
        syncer.push(0, 1, 0, 1.0, _ones(1.0), push_id="a")
        closing = threading.Thread(target=lambda: answers.update(
            late=syncer.push(1, 1, 0, 1.0, _ones(1.0), push_id="b")))  # fmt: skip
        closing.start()
        assert written.wait(30)
        beat = threading.Thread(
            target=lambda: answers.update(beat=syncer.heartbeat(0, 1), status=syncer.status())
        )
        beat.start()
        beat.join(10)
        assert not beat.is_alive() and answers["beat"] == 0 and answers["status"]["closing"]
        assert closing.is_alive() and syncer.round == 0  # the answer waits for the write
        release.set()
        closing.join(30)
        assert answers["late"] == 0 and syncer.round == 1
    finally:
        release.set()
        syncer.close()


def test_failed_authentication_is_refused_at_once_and_logged_in_counted_lines(tmp_path, caplog):
    """Five wrong credentials from one peer: each refused, lines at the counts 1, 2 and 4 (and
    ``auth_failed`` events in the tape with them), no worker made to wait. Then the
    :class:`identity.Failures` alone on a test clock: 1100 failures of one peer make 11 lines
    (1, 2, ..., 1024; the old slowdown overflowed at 1027); 100 peers make at most
    :data:`identity.LOG_LINES` lines in a window, and the first line of the next window says
    how many were left out."""
    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    server = service.Server(syncer, "127.0.0.1", 0, secret="s").start()
    wrong = service.Client(f"127.0.0.1:{server.port}", "learner.0.forged", timeout=10)
    try:
        with caplog.at_level(logging.WARNING, "diloco_jax"):
            for _ in range(5):
                with pytest.raises(service.RefusedBySyncer, match="wrong credential"):
                    wrong.call("Heartbeat", {"learner": 0, "generation": 1})
    finally:
        wrong.close()
        server.stop()
        syncer.close()
    once = dict.fromkeys(caplog.records)  # each record once, wherever pytest's handlers sit
    lines = [r.getMessage() for r in once if "failed authentication" in r.getMessage()]
    assert [line.split(" failed")[0].split()[-1] for line in lines] == ["1", "2", "4"]
    assert "from 127.0.0.1" in lines[0]
    assert [e["count"] for e in _tape(tmp_path) if e["event"] == "auth_failed"] == [1, 2, 4]
    now = [0.0]
    events: list = []
    failures = identity.Failures(lambda *a, **k: events.append(k), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "diloco_jax"):
        caplog.clear()
        counts = [failures.failed("10.9.9.9", "test") for _ in range(1100)]  # past 1026
        assert counts == list(range(1, 1101)) and len(dict.fromkeys(caplog.records)) == 11
        now[0] += identity.LOG_EVERY
        caplog.clear()
        for i in range(100):
            failures.failed(f"10.0.0.{i}", "test")
        assert len(dict.fromkeys(caplog.records)) == identity.LOG_LINES
        now[0] += identity.LOG_EVERY
        failures.failed("10.0.0.200", "test")
    assert f"{100 - identity.LOG_LINES} line(s) about other failures left out" in (
        caplog.records[-1].getMessage()
    )
    assert failures.total == 1201 and len(events) == 11 + identity.LOG_LINES + 1


def test_the_syncer_refuses_to_listen_in_clear_off_loopback(tmp_path):
    """Off loopback without TLS: one line naming syncer.credentials and syncer.insecure; with
    ``insecure`` it listens (saying so). The status page follows the same rule."""
    from diloco_jax.learners.status import StatusServer

    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    try:
        with pytest.raises(ValueError, match="without TLS: set syncer.credentials .* or "
                           "syncer.insecure=true"):  # fmt: skip
            service.Server(syncer, "0.0.0.0", 0, secret="s")
        with pytest.raises(ValueError, match="status page would listen on 0.0.0.0 without TLS"):
            StatusServer(syncer, "0.0.0.0", 0, secret="s")
        server = service.Server(syncer, "0.0.0.0", 0, secret="s", insecure=True)
        server.stop(0)
    finally:
        syncer.close()


def test_the_status_page_is_https_with_the_syncers_certificate(tmp_path):
    """With the syncer's credentials the status page speaks HTTPS only, verified against the
    run's CA, and answers the operator's credential alone."""
    import ssl
    import urllib.error
    import urllib.request

    from diloco_jax.learners.status import StatusServer

    folder, secret = _credentials(tmp_path, 1)
    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    page = StatusServer(syncer, "127.0.0.1", 0, secret=secret,
                        tls=certs.read(folder / "syncer")).start()  # fmt: skip
    trust = ssl.create_default_context(cafile=str(folder / "operator" / "ca.pem"))

    def get(scheme, credential):
        request = urllib.request.Request(
            f"{scheme}://localhost:{page.port}/status",
            headers={"Authorization": f"Bearer {credential}"},
        )
        with urllib.request.urlopen(request, context=trust, timeout=10) as r:
            return json.loads(r.read())

    try:
        assert get("https", identity.operator_credential(secret))["round"] == 0
        with pytest.raises(urllib.error.HTTPError, match="401"):
            get("https", identity.learner_credential(secret, 0))
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            get("http", identity.operator_credential(secret))  # no plain HTTP on the port
    finally:
        page.stop()
        syncer.close()
