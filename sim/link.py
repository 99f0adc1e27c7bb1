"""An emulated network link between a learner and the syncer: a TCP proxy that shapes each
direction of the byte stream by bandwidth, latency and jitter, and cuts it for a schedule of
outages.

    python -m sim.link --listen 127.0.0.1:50552 --to 127.0.0.1:50551 \\
        --bandwidth 100mbit --latency 50ms [--jitter 5ms] [--outage 60:90] [--seed 0]

A learner given ``syncer.address=127.0.0.1:50552`` reaches the syncer through the link. A link
forwards bytes without reading them, so TLS and gRPC pass through it unchanged. One link per
learner: each has its own port, profile and outages.

The model, for each direction (up: towards the target; down: back), shared by the link's
connections. A chunk of ``n_i`` bytes read from the stream at ``t_i`` leaves once the link has
sent what came before it, and arrives ``latency`` (give or take ``jitter``) later::

    depart_i  = max(t_i, depart_{i-1}) + n_i / bandwidth
    deliver_i = max(depart_i + latency + u_i, deliver_{i-1}),   u_i ~ U[-jitter, jitter]

``u`` comes from a generator seeded by ``(seed, direction)``: for a seed the delays are a pure
function of the chunks read. Deliveries keep their order, so jitter never reorders the stream.
So ``B`` bytes written at once arrive, the last of them, ``B / bandwidth + latency`` later.
``bandwidth`` counts the stream's bytes (not TCP/IP headers); None: no limit. A new
connection's bytes leave no earlier than one round trip (latency up + down) after it was
accepted, the time TCP's handshake takes. At most ``buffer`` bytes wait to leave (and what is
in flight): beyond that the link stops reading and the sender blocks, as on a real path.

Outages: ``(start_s, end_s)`` from the link's start. At a start, every open connection is reset
(both ends see a RST, as when a middlebox loses its route); a connection made during an outage
is reset as soon as it is accepted. Afterwards the link works again.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from diloco_jax.base.commandline import ArgumentParser

CHUNK = 1 << 16  # the most one read takes from a stream: 0.5 ms at 1 Gbit/s
POLL_S = 0.2  # how often a thread blocked on a socket looks whether its connection was cut
UP, DOWN = "up", "down"


class Profile(NamedTuple):
    """One direction of a link: ``bandwidth`` in bytes/s (None: no limit), ``latency`` and
    ``jitter`` in seconds (each delivery ``latency + U[-jitter, jitter]`` after it leaves)."""

    bandwidth: float | None
    latency: float
    jitter: float


class Shaper:
    """One direction's timing (the module's equations): when each chunk read is delivered,
    and what crossed (``bytes``; ``busy_s``: seconds spent sending at the bandwidth; ``lag_s``:
    the most a delivery started behind its time, the emulation's own error). Thread-safe."""

    def __init__(self, profile: Profile, seed: int, direction: str):
        self.profile = profile
        self._rng = random.Random(f"{seed}:{direction}")
        self._lock = threading.Lock()
        self.free_at = self.last = -math.inf
        self.bytes, self.busy_s, self.lag_s = 0, 0.0, 0.0

    def admit(self, now: float, n: int) -> float:
        """The time the ``n`` bytes read at ``now`` are delivered."""
        bandwidth, latency, jitter = self.profile
        with self._lock:
            send_s = n / bandwidth if bandwidth else 0.0
            self.free_at = max(now, self.free_at) + send_s
            u = self._rng.uniform(-jitter, jitter) if jitter else 0.0
            self.last = max(self.free_at + latency + u, self.last)
            self.busy_s += send_s
            return self.last

    def delivered(self, n: int, lag_s: float) -> None:
        with self._lock:
            self.bytes += n
            self.lag_s = max(self.lag_s, lag_s)

    def clear(self) -> None:
        """Forget the queue (an outage dropped it)."""
        with self._lock:
            self.free_at = self.last = -math.inf


def _pair(name: str, value) -> tuple:
    """``(up, down)`` of a value given for both directions or as a pair."""
    if isinstance(value, tuple | list):
        if len(value) != 2:
            raise ValueError(f"{name} is one value or (up, down), got {value!r}")
        return tuple(value)
    return value, value


def profiles(bandwidth=None, latency=0.0, jitter=0.0) -> tuple[Profile, Profile]:
    """The ``(up, down)`` profiles of a link's arguments, each one value or ``(up, down)``.
    Raises ``ValueError`` naming the argument."""
    out = []
    for b, lat, jit in zip(*(_pair(n, v) for n, v in (("bandwidth", bandwidth),
                           ("latency", latency), ("jitter", jitter))), strict=True):  # fmt: skip
        if b is not None and not b > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s (None: no limit), got {b}")
        if not 0 <= lat < math.inf:
            raise ValueError(f"latency must be >= 0 seconds, got {lat}")
        if not 0 <= jit <= lat:
            raise ValueError(f"jitter must be in [0, latency = {lat}] seconds, got {jit}")
        out.append(Profile(None if b is None else float(b), float(lat), float(jit)))
    return out[0], out[1]


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a RST rather than a FIN (a connection lost, not ended)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Pipe:
    """One direction of one connection: a reader thread that stamps each chunk with its
    delivery time, a writer thread that sends it then."""

    def __init__(self, conn: _Connection, src, dst, shaper: Shaper, limit: int):
        self.conn, self.src, self.dst, self.shaper, self.limit = conn, src, dst, shaper, limit
        self.items: deque[tuple[float, bytes | None]] = deque()
        self.queued = 0
        self.cond = threading.Condition()

    def read(self) -> None:
        try:
            while not self.conn.cut:
                try:
                    data = self.src.recv(CHUNK)
                except TimeoutError:
                    continue
                now = max(time.monotonic(), self.conn.ready_at)
                at = self.shaper.admit(now, len(data))  # an end (b"") is delivered in turn too
                with self.cond:
                    self.items.append((at, data or None))
                    self.queued += len(data)
                    self.cond.notify_all()
                    while self.queued > self.limit and not self.conn.cut:
                        self.cond.wait(POLL_S)
                if not data:
                    return
        except OSError:
            self.conn.cut_off()

    def write(self) -> None:
        try:
            while True:
                with self.cond:
                    if self.conn.cut:
                        return
                    if not self.items:
                        self.cond.wait()
                        continue
                    at, data = self.items[0]
                    wait = at - time.monotonic()
                    if wait > 0:
                        self.cond.wait(wait)
                        continue
                    self.items.popleft()
                if data is None:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.shaper.delivered(len(data), time.monotonic() - at)  # before the peer sees it
                self._send(data)
                with self.cond:
                    self.queued -= len(data)
                    self.cond.notify_all()
        except OSError:
            self.conn.cut_off()

    def _send(self, data: bytes) -> None:
        view, sent = memoryview(data), 0
        while sent < len(data):
            if self.conn.cut:
                raise ConnectionAbortedError("cut")
            try:
                sent += self.dst.send(view[sent:])
            except TimeoutError:
                continue


class _Connection:
    """A client's connection and the link's to the target: four threads, two per direction.
    The last to finish closes both sockets (with a RST when the connection was cut)."""

    def __init__(self, link: Link, client: socket.socket, server: socket.socket, accepted: float):
        self.link, self.socks = link, (client, server)
        self.ready_at = accepted + link.up.profile.latency + link.down.profile.latency
        self.cut, self._lock, self._running = False, threading.Lock(), 4
        for sock in self.socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(POLL_S)
        up, down = link.up, link.down
        self.pipes = (_Pipe(self, client, server, up, link.limit(up.profile)),
                      _Pipe(self, server, client, down, link.limit(down.profile)))  # fmt: skip

    def start(self) -> None:
        for pipe in self.pipes:
            for fn in (pipe.read, pipe.write):
                threading.Thread(target=self._run, args=(fn,), daemon=True).start()

    def _run(self, fn) -> None:
        try:
            fn()
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                for sock in self.socks:
                    if self.cut:
                        _reset(sock)
                    else:
                        sock.close()
                self.link._closed(self)

    def cut_off(self) -> None:
        """Reset the connection at both ends (an outage, or a reset from one end)."""
        with self._lock:
            if self.cut:
                return
            self.cut = True
        for sock in self.socks:
            try:
                sock.shutdown(socket.SHUT_RD)  # wakes the reader; sends nothing
            except OSError:
                pass
        for pipe in self.pipes:
            with pipe.cond:
                pipe.cond.notify_all()


class Link:
    """An emulated link to ``target`` ``(host, port)``, listening at ``listen`` (port 0: a free
    one, see :attr:`address`). ``bandwidth`` (bytes/s, None: no limit), ``latency`` and
    ``jitter`` (seconds): each one value or ``(up, down)``; ``outages``: ``(start_s, end_s)``
    from :meth:`start`; ``seed``: the jitter's; ``buffer``: the bytes that may wait to leave.
    A context manager (started on entry). Counters: :attr:`up` and :attr:`down` (their
    ``bytes``, ``busy_s``, ``lag_s``), ``connections``, ``resets`` (cut by an outage),
    ``refused`` (reset while down, or the target unreachable)."""

    def __init__(self, target: tuple[str, int], *, bandwidth=None, latency=0.0, jitter=0.0,
                 outages: Sequence[tuple[float, float]] = (), seed: int = 0,
                 listen: tuple[str, int] = ("127.0.0.1", 0), buffer: int = 1 << 20):  # fmt: skip
        up, down = profiles(bandwidth, latency, jitter)
        self.outages = sorted((float(a), float(b)) for a, b in outages)
        for a, b in self.outages:
            if not 0 <= a < b:
                raise ValueError(f"an outage is (start_s, end_s), 0 <= start < end, got {(a, b)}")
        if buffer < CHUNK:
            raise ValueError(f"buffer must be at least {CHUNK} bytes, got {buffer}")
        self.target, self.listen, self.buffer = target, listen, buffer
        self.up, self.down = Shaper(up, seed, UP), Shaper(down, seed, DOWN)
        self.connections = self.resets = self.refused = 0
        self.started_at = math.nan
        self._open: set[_Connection] = set()
        self._lock, self._stopped = threading.Lock(), threading.Event()
        self._listener: socket.socket | None = None

    def limit(self, p: Profile) -> int:
        """The bytes one direction holds before it stops reading: what waits and what flies."""
        flying = (p.bandwidth or 0) * (p.latency + p.jitter)
        return int(self.buffer + flying) if p.bandwidth else self.buffer * 64

    @property
    def address(self) -> str:
        assert self._listener is not None, "start the link first"
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def elapsed(self) -> float:
        """Seconds since the link started (the outages' clock)."""
        return time.monotonic() - self.started_at

    def down_at(self, t: float) -> bool:
        return any(a <= t < b for a, b in self.outages)

    def start(self) -> Link:
        self._listener = socket.create_server(self.listen)
        self._listener.settimeout(POLL_S)
        self.started_at = time.monotonic()
        for fn in (self._accept, self._outages):
            threading.Thread(target=fn, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
        self._cut_all()

    def __enter__(self) -> Link:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:  # stopped
                return
            accepted = time.monotonic()
            server = None
            if not self.down_at(accepted - self.started_at):
                try:
                    server = socket.create_connection(self.target, timeout=5)
                except OSError:
                    pass
            with self._lock:  # an outage's sweep takes the lock: a connection is cut or refused
                if server is None or self.down_at(time.monotonic() - self.started_at):
                    self.refused += 1
                    for sock in (client, server):
                        if sock is not None:
                            _reset(sock)
                    continue
                conn = _Connection(self, client, server, accepted)
                self._open.add(conn)
                self.connections += 1
            conn.start()

    def _outages(self) -> None:
        for start, _ in self.outages:
            if self._stopped.wait(max(0.0, self.started_at + start - time.monotonic())):
                return
            self.resets += self._cut_all()
            self.up.clear()
            self.down.clear()

    def _cut_all(self) -> int:
        with self._lock:
            conns = list(self._open)
            for conn in conns:
                conn.cut_off()
        return len(conns)

    def _closed(self, conn: _Connection) -> None:
        with self._lock:
            self._open.discard(conn)

    def summary(self) -> str:
        return (f"up {self.up.bytes} B ({self.up.busy_s:.3f} s sending, lag <= "
                f"{self.up.lag_s * 1e3:.2f} ms), down {self.down.bytes} B ({self.down.busy_s:.3f} "
                f"s sending, lag <= {self.down.lag_s * 1e3:.2f} ms); {self.connections} "
                f"connections, {self.resets} cut by outages, {self.refused} refused")  # fmt: skip


# ---- the command line -------------------------------------------------------------------

_NUMBER = re.compile(r"(\d+\.?\d*(?:e[+-]?\d+)?|\.\d+)\s*([a-z]*)", re.I)
_RATES = {"": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9,  # bytes/s; bits/s:
          "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}  # fmt: skip
_TIMES = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}


def _quantity(text: str, units: dict[str, float], what: str) -> float:
    m = _NUMBER.fullmatch(text.strip())
    if not m or m.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return float(m.group(1)) * units[m.group(2).lower()]


def rate(text: str) -> float | None:
    """Bytes/s of ``100mbit``, ``1gbit``, ``12.5MB``, ``500kB/s`` or ``1e6`` (bytes/s; prefixes
    are decimal); ``none``: no limit."""
    if text.strip().lower() in ("none", "inf"):
        return None
    return _quantity(text.strip().removesuffix("/s"), _RATES,
                     "a rate: write e.g. 100mbit, 1gbit, 12.5MB (bytes/s) or none")  # fmt: skip


def seconds(text: str) -> float:
    """Seconds of ``50ms``, ``1.5s``, ``200us`` or ``0.05``."""
    return _quantity(text, _TIMES, "a time: write e.g. 50ms, 1.5s, 200us")


def _both(parse):
    def pair(text: str):
        parts = text.split(",")
        if len(parts) > 2:
            raise argparse.ArgumentTypeError(f"{text!r}: give one value or UP,DOWN")
        values = [parse(p) for p in parts]
        return values[0] if len(values) == 1 else tuple(values)

    pair.__name__ = parse.__name__
    return pair


def _outage(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not START:END (e.g. 60:90, 1.5s:2s)")
    return seconds(start), seconds(end)


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m sim.link", description="An emulated link to a syncer: "
                       "bandwidth, latency, jitter and outages.")  # fmt: skip
    p.add_argument("--to", type=_address, required=True, metavar="HOST:PORT",
                   help="the target (the syncer's address)")  # fmt: skip
    p.add_argument("--listen", type=_address, default=("127.0.0.1", 0), metavar="HOST:PORT",
                   help="where learners connect (default 127.0.0.1:0, a free port)")  # fmt: skip
    p.add_argument("--bandwidth", type=_both(rate), default=None, metavar="RATE[,DOWN]",
                   help="100mbit, 1gbit, 12.5MB (bytes/s) or none (default)")  # fmt: skip
    p.add_argument("--latency", type=_both(seconds), default=0.0, metavar="TIME[,DOWN]",
                   help="one way: 50ms, 0.05 (seconds); default 0")  # fmt: skip
    p.add_argument("--jitter", type=_both(seconds), default=0.0, metavar="TIME[,DOWN]",
                   help="each delivery latency +- up to this (at most the latency)")  # fmt: skip
    p.add_argument("--outage", type=_outage, action="append", default=[], metavar="START:END",
                   help="seconds from the start when the link is down (repeatable)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the jitter's seed")
    p.add_argument("--duration", type=seconds, default=None, metavar="TIME",
                   help="stop after this long (default: at Ctrl-C or SIGTERM)")  # fmt: skip
    return p.parse_args(argv)


def link_of(args: argparse.Namespace) -> Link:
    """The (not yet started) link a parsed command line describes."""
    return Link(args.to, bandwidth=args.bandwidth, latency=args.latency, jitter=args.jitter,
                outages=args.outage, seed=args.seed, listen=args.listen)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    try:
        link = link_of(args).start()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        host, port = args.listen
        print(f"error: --listen {host}:{port}: {e.strerror or e}", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"link {link.address} -> {args.to[0]}:{args.to[1]}", flush=True)
    try:
        threading.Event().wait(args.duration)
    except KeyboardInterrupt:
        pass
    finally:
        link.stop()
        print(link.summary(), flush=True)


if __name__ == "__main__":
    main()
