"""The emulated link of sim/link.py checked against its own definition (issue 55): B bytes take
B / bandwidth + latency, each direction on its own; a small message takes the latency each
way; jitter is a pure function of its seed and never reorders the stream; an outage resets
what is open and refuses what comes, then the link works again; gRPC over TLS to a real
syncer crosses it.

These are timing tests, and timings belong in benchmarks (docs/STYLE): here the timing is
what the link is for, so its definition is what is checked, to the issue's 10%. Every transfer
is dominated by sleeping (latency, or bytes over a bandwidth of a few MB/s), not by the CPU,
so a loaded machine's noise (a few ms) stays well under the tolerance."""

import os
import socket
import threading
import time

import pytest

from sim import link as link_lib
from sim.link import Link

TOLERANCE = 0.10  # the issue's: "within 10%"


def _within(got: float, want: float) -> bool:
    return abs(got - want) <= TOLERANCE * want


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _Ends:
    """A target server on 127.0.0.1, a link to it, and a client connected through the link:
    ``client`` and ``server``, the two ends of one connection, both in this process."""

    def __init__(self, **link_args):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.link = Link(("127.0.0.1", self.listener.getsockname()[1]), **link_args).start()
        self.connected_at = time.perf_counter()
        self.client, self.server = self.connect()

    def connect(self) -> tuple[socket.socket, socket.socket]:
        client = _nodelay(socket.create_connection(_host_port(self.link.address), timeout=10))
        server, _ = self.listener.accept()
        server.settimeout(10)
        return client, _nodelay(server)

    def close(self) -> None:
        for sock in (self.client, self.server, self.listener):
            sock.close()
        self.link.stop()


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _receive(sock: socket.socket, n: int, out: dict, key: str) -> None:
    """Reads ``n`` bytes; ``out[key]`` = (the time the last arrived, the bytes)."""
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(1 << 16)
        assert chunk, f"{key}: the stream ended after {len(got)} of {n} bytes"
        got += chunk
    out[key] = (time.perf_counter(), bytes(got))


def _ping(a: socket.socket, b: socket.socket) -> float:
    """Seconds for one byte from ``a`` to ``b`` and one back."""
    start = time.perf_counter()
    a.sendall(b"p")
    assert b.recv(1) == b"p"
    b.sendall(b"q")
    assert a.recv(1) == b"q"
    return time.perf_counter() - start


def test_bytes_take_their_size_over_the_bandwidth_plus_the_latency_each_way_on_its_own():
    """Up 2 MB/s and 50 ms, down 4 MB/s and 100 ms; 600 kB written at once each way, at the
    same time: the last byte up arrives after 0.3 + 0.05 s, the last down after 0.15 + 0.1 s
    (within 10%), every byte intact. A shared pipe would take 0.6 s for both."""
    ends = _Ends(bandwidth=(2e6, 4e6), latency=(0.05, 0.1))
    try:
        _ping(ends.client, ends.server)  # the connection's handshake is behind us
        up, down = os.urandom(600_000), os.urandom(600_000)
        got: dict = {}
        readers = [threading.Thread(target=_receive, args=(sock, n, got, key))
                   for sock, n, key in ((ends.server, len(up), "up"),
                                        (ends.client, len(down), "down"))]  # fmt: skip
        for t in readers:
            t.start()
        start = time.perf_counter()
        writers = [threading.Thread(target=ends.client.sendall, args=(up,)),
                   threading.Thread(target=ends.server.sendall, args=(down,))]  # fmt: skip
        for t in writers:
            t.start()
        for t in writers + readers:
            t.join(10)
    finally:
        ends.close()
    assert got["up"][1] == up and got["down"][1] == down
    took = {key: got[key][0] - start for key in ("up", "down")}
    want = {"up": len(up) / 2e6 + 0.05, "down": len(down) / 4e6 + 0.1}
    assert all(_within(took[k], want[k]) for k in want), (took, want)
    assert ends.link.up.bytes == len(up) + 1 and ends.link.down.bytes == len(down) + 1
    assert _within(ends.link.up.busy_s, want["up"] - 0.05)


def test_a_small_message_takes_the_latency_each_way_and_a_new_connection_a_round_trip_more():
    """Latency 100 ms each way: a byte there and back takes 0.2 s (within 10%); on a new
    connection the first takes 0.4 s, TCP's handshake (one round trip) before it."""
    ends = _Ends(bandwidth=1e6, latency=0.1)
    try:
        first = time.perf_counter() - ends.connected_at + _ping(ends.client, ends.server)
        rtts = [_ping(ends.client, ends.server) for _ in range(3)]
    finally:
        ends.close()
    want = 2 * (0.1 + 1 / 1e6)
    assert all(_within(rtt, want) for rtt in rtts), rtts
    assert _within(first, 2 * want), first


def test_jitter_is_a_function_of_its_seed_and_never_reorders():
    """The model (``Shaper``) for 1000 chunks of 1 kB, latency 20 ms, jitter 10 ms: read every
    ms, the same seed gives the same deliveries, another seed others, and they never go
    backwards; read every 50 ms, the delays spread over latency +- jitter, their mean the
    latency. Through a link
    with that jitter, 400 kB in small writes arrive intact and in order, in B / bandwidth +
    latency +- jitter."""

    def schedule(seed, every):
        shaper = link_lib.Shaper(link_lib.Profile(4e6, 0.02, 0.01), seed, link_lib.UP)
        return [shaper.admit(i * every, 1000) for i in range(1000)]

    a, b, other = schedule(7, 1e-3), schedule(7, 1e-3), schedule(8, 1e-3)
    assert a == b and a != other
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))  # the dense case needs it
    spaced = schedule(7, 0.05)  # each chunk long after the last: no delivery held back
    delays = [t - (i * 0.05 + 1000 / 4e6) for i, t in enumerate(spaced)]
    assert 0.01 - 1e-9 <= min(delays) < 0.0105 and 0.0295 < max(delays) <= 0.03 + 1e-9
    assert abs(sum(delays) / len(delays) - 0.02) < 1e-3
    ends = _Ends(bandwidth=2e6, latency=0.02, jitter=0.02, seed=3)
    try:
        _ping(ends.client, ends.server)
        data, got = os.urandom(400_000), {}
        reader = threading.Thread(target=_receive, args=(ends.server, len(data), got, "up"))
        reader.start()
        start = time.perf_counter()
        for i in range(0, len(data), 1000):
            ends.client.sendall(data[i : i + 1000])
        reader.join(10)
    finally:
        ends.close()
    assert got["up"][1] == data
    took = got["up"][0] - start
    assert 0.9 * (0.2 + 0.02 - 0.02) <= took <= 1.1 * (0.2 + 0.02 + 0.02), took


def test_an_outage_resets_open_connections_refuses_new_ones_then_the_link_works_again():
    """Down from 0.5 s to 1.0 s: a connection open at 0.5 s is reset then, one made at 0.6 s
    is reset at once, and one made after 1.0 s carries bytes again."""
    ends = _Ends(latency=0.01, outages=[(0.5, 1.0)])
    try:
        _ping(ends.client, ends.server)
        ends.client.settimeout(5)
        with pytest.raises(ConnectionResetError):
            ends.client.recv(1)
        cut = ends.link.elapsed()
        assert 0.5 <= cut < 0.6, cut
        time.sleep(0.6 - ends.link.elapsed())
        with pytest.raises(ConnectionResetError):  # at its connect or its first read
            with socket.create_connection(_host_port(ends.link.address), timeout=5) as during:
                during.recv(1)
        time.sleep(max(0.0, 1.0 - ends.link.elapsed()))
        ends.client, ends.server = ends.connect()
        _ping(ends.client, ends.server)
    finally:
        ends.close()
    link = ends.link
    assert (link.connections, link.resets, link.refused) == (2, 1, 1)


def test_grpc_over_tls_to_a_real_syncer_crosses_the_link_and_rides_out_an_outage(tmp_path):
    """A learner's client joins and heartbeats a TLS syncer (mutual TLS) through a link of
    50 ms each way: a heartbeat takes at least the round trip, and the link carried the
    bytes. Through a second link, down for its first second, a heartbeat is retried by the
    client until the link is up, then answered."""
    from diloco_jax.learners import certs, identity, service, wire
    from tests.test_learners import _algorithm, _syncer
    from tests.test_syncer_security import KEYS, X, _credentials

    folder, secret = _credentials(tmp_path, 1)
    syncer = _syncer(tmp_path, _algorithm(), learners=1)
    server = service.Server(syncer, "127.0.0.1", 0, secret=secret, mutual=True,
                            tls=certs.read(folder / "syncer")).start()  # fmt: skip
    target = ("127.0.0.1", server.port)

    def client(address: str) -> service.Client:
        return service.Client(address, identity.learner_credential(secret, 0), timeout=10,
                              patience=20, tls=certs.read(folder / "learner_0"))  # fmt: skip

    beat = ("Heartbeat", {"learner": 0, "generation": 1})
    try:
        with Link(target, latency=0.05, bandwidth=12.5e6) as link:
            learner = client(link.address)
            joined = learner.call("Join", {"learner": 0, "describe": wire.describe(X),
                                           "keys": KEYS}, wire.named(X))  # fmt: skip
            start = time.perf_counter()
            learner.call(*beat)
            took = time.perf_counter() - start
            learner.close()
        with Link(target, latency=0.01, outages=[(0.0, 1.0)]) as cut:
            late = client(cut.address)
            late.call(*beat)
            answered = cut.elapsed()
            late.close()
    finally:
        server.stop()
        syncer.close()
    assert joined[0]["generation"] == 1
    assert took >= 2 * 0.05, took
    assert link.up.bytes > X["w"].nbytes and link.down.bytes > X["w"].nbytes
    assert answered >= 1.0 and cut.refused >= 1 and cut.connections >= 1


def test_the_command_line_reads_units_and_refuses_a_bad_value_in_one_line(capsys):
    args = link_lib.parse(["--to", "127.0.0.1:50551", "--bandwidth", "100mbit,1gbit",
                           "--latency", "50ms", "--jitter", "5ms,2ms", "--outage", "60:90",
                           "--outage", "1.5s:2000ms", "--seed", "3"])  # fmt: skip
    link = link_lib.link_of(args)
    assert link.up.profile == link_lib.Profile(12.5e6, 0.05, 0.005)
    assert link.down.profile == link_lib.Profile(125e6, 0.05, 0.002)
    assert link.outages == [(1.5, 2.0), (60.0, 90.0)] and link.target == ("127.0.0.1", 50551)
    assert link_lib.rate("12.5MB") == 12.5e6 and link_lib.rate("none") is None
    assert link_lib.rate("8kbit/s") == 1e3 and link_lib.seconds("200us") == pytest.approx(2e-4)
    for argv, message in [
        (["--bandwidth", "100mbps"], "'100mbps' is not a rate"),
        (["--latency", "fast"], "'fast' is not a time"),
        (["--outage", "60"], "'60' is not START:END"),
        (["--latency", "10ms", "--jitter", "20ms"], "jitter must be in [0, latency = 0.01]"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as e:
            link_lib.main(["--to", "127.0.0.1:50551", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and message in err, err
