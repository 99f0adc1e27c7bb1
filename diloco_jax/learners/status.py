"""The syncer's status over HTTP (``syncer.status_port``): ``/`` a page a person reads,
``/status`` the same as JSON, ``/metrics`` for Prometheus. Every read needs the operator's
credential (``Authorization: Bearer CREDENTIAL``, :func:`.identity.operator_credential`), on
loopback too; any other is refused at once and counted per address (:class:`.identity.Failures`).
With the syncer's certificate the page is HTTPS (with ``mutual``, the operator's client
certificate is needed too); off loopback it must be, unless ``insecure``.

Anyone who reaches the port can hold connections, so they are bounded (issue 60): ``max_open``
at once (one more evicts a connection that has sent no request yet, of the address with the most
of those, or is closed itself); ``timeout`` seconds from the accept to finish the TLS handshake
and the request head (:data:`MAX_HEAD` bytes at most), as long for each write of the answer. One
thread moves every handshake and request along without blocking; :data:`WORKERS` threads answer
complete requests: an idle, slow or silent client costs a descriptor for ``timeout`` seconds,
never a thread, and delays no one. A refused, broken or expired connection is counted
(:attr:`StatusServer.closed`) in a log line, never a traceback."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import html
import io
import json
import logging
import pathlib
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from diloco_jax.base.access import is_loopback
from diloco_jax.learners import identity
from diloco_jax.learners.syncer import Syncer

log = logging.getLogger("diloco_jax")
MAX_OPEN = 32  # connections open at once: the gRPC port's learners need descriptors too
WORKERS = 4  # requests answered at once (an answer is a few kilobytes, written in milliseconds)
MAX_HEAD = 8192  # bytes of request line and headers (a browser's or curl's are under 2 KiB)
TIMEOUT = 5.0  # seconds a connection has to send its request, and each write to take
POLL = 0.1  # seconds between the serving thread's looks at deadlines and stop()
LOUD = ("full", "evicted")  # closings that say the page is flooded: warned at counts 1, 2, 4, ...
STATUSES = ("present", "dropped", "left")


def _registry(syncer: Syncer) -> tuple[CollectorRegistry, Callable[[], dict]]:
    registry = CollectorRegistry()
    gauges = {
        "round": Gauge("diloco_syncer_round", "rounds closed", registry=registry),
        "learners": Gauge(
            "diloco_syncer_learners", "learners by status", ["status"], registry=registry
        ),  # fmt: skip
        "pending": Gauge(
            "diloco_syncer_pending_pushes", "pushes in the open round", registry=registry
        ),  # fmt: skip
        "bytes_in": Gauge("diloco_syncer_bytes_in", "array bytes received", registry=registry),
        "bytes_out": Gauge("diloco_syncer_bytes_out", "array bytes sent", registry=registry),
        "waited": Gauge(
            "diloco_syncer_waited_seconds", "seconds rounds stood open", registry=registry
        ),  # fmt: skip
        "timeout": Gauge(
            "diloco_syncer_round_timeout_seconds",
            "a round's deadline after its first push",
            registry=registry,
        ),  # fmt: skip
        "quorum": Gauge(
            "diloco_syncer_quorum", "pushes a round needs (0: every learner)", registry=registry
        ),  # fmt: skip
        "grace": Gauge(
            "diloco_syncer_grace_seconds",
            "the grace window in force after a quorum",
            registry=registry,
        ),  # fmt: skip
        "late": Gauge(
            "diloco_syncer_late_pushes", "pushes merged into a later round", registry=registry
        ),  # fmt: skip
    }

    def update() -> dict:
        st = syncer.status()
        gauges["round"].set(st["round"])
        for status in STATUSES:
            count = sum(m["status"] == status for m in st["members"].values())
            gauges["learners"].labels(status).set(count)
        gauges["pending"].set(len(st["pending"]))
        gauges["bytes_in"].set(st["bytes_in"])
        gauges["bytes_out"].set(st["bytes_out"])
        gauges["waited"].set(st["waited_seconds"])
        gauges["timeout"].set(st["timeout"])
        gauges["quorum"].set(st["quorum"])
        gauges["grace"].set(st["grace_in_force"])
        gauges["late"].set(sum(m["late"] for m in st["members"].values()))
        return st

    return registry, update


def page(st: dict) -> str:
    """The status as a small HTML page."""
    rows = "".join(
        f"<tr><td>{i}</td><td>{html.escape(m['status'])}</td><td>{m['generation']}</td>"
        f"<td>{m['joined_round']}</td><td>{m['pushes']}</td><td>{m['late']}</td></tr>"
        for i, m in st["members"].items()
    )
    grace = f", grace {st['grace_in_force']}s (at most {st['grace']}s)" if st["quorum"] else ""
    return (
        "<!doctype html><title>diloco-jax syncer</title><h1>syncer</h1>"
        f"<p>round {st['round']}, {st['learners']} learners declared, mode {st['mode']}{grace}, "
        f"timeout {st['timeout']}s, dead after {st['dead_after']}s; {len(st['pending'])} "
        f"pushes in, waiting for {st['waiting_for']}; {st['bytes_in']:,} bytes in, "
        f"{st['bytes_out']:,} out</p><table><tr><th>learner</th><th>status</th>"
        "<th>generation</th><th>joined at round</th><th>pushes</th><th>late</th></tr>"
        f"{rows}</table>"
    )


def _canned(status: str, body: bytes = b"") -> bytes:
    """A whole HTTP/1.0 answer, given without reading the request's headers."""
    return (f"HTTP/1.0 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body  # fmt: skip


PLAIN_ON_TLS = _canned("400 Bad Request", b"this port speaks HTTPS\n")
TOO_LARGE = _canned("431 Request Header Fields Too Large")


@dataclasses.dataclass(eq=False)
class _Conn:
    """An accepted connection: its socket (in TLS once its first byte is a TLS record's), peer,
    deadline, request head so far, whether its bytes are the request's (handshake done or none
    due), and the canned answer it gets instead of the page's, if any."""

    sock: socket.socket
    peer: str
    deadline: float
    ready: bool
    head: bytearray = dataclasses.field(default_factory=bytearray)
    refusal: bytes | None = None

    def complete(self) -> bool:
        return b"\r\n\r\n" in self.head or b"\n\n" in self.head or len(self.head) > MAX_HEAD


def _common_name(sock: socket.socket) -> str | None:
    """The common name of the client certificate ``sock``'s peer showed (None: no TLS or none)."""
    cert: Any = sock.getpeercert() if isinstance(sock, ssl.SSLSocket) else None
    names = [v for rdn in (cert or {}).get("subject", ()) for k, v in rdn if k == "commonName"]
    return names[0] if len(names) == 1 else None


def _reason(e: OSError) -> str:
    """A closing's reason as :attr:`StatusServer.closed` counts it (few distinct values)."""
    if isinstance(e, TimeoutError):
        return "too slow"
    if isinstance(e, ssl.SSLError):  # not TLS, no or a foreign certificate, a torn handshake
        return f"TLS: {e.reason or type(e).__name__}"
    return "disconnected"


class StatusServer:
    """Serves ``syncer``'s status at ``host:port`` in a thread (0: a free port); ``secret``:
    the run's (the operator's credential is derived from it); ``tls``: the syncer's
    :class:`~.certs.Tls` (None: plain HTTP, refused off loopback unless ``insecure``);
    ``mutual``: a client certificate of the run's CA naming the operator is needed too;
    ``timeout``, ``max_open``: the bounds of the module's docstring; ``failures``: where wrong
    credentials are counted (default: a count of the page's own, into the syncer's tape)."""

    def __init__(self, syncer: Syncer, host: str, port: int, *, secret: str, tls=None,
                 mutual: bool = False, insecure: bool = False, timeout: float = TIMEOUT,
                 max_open: int = MAX_OPEN, failures: identity.Failures | None = None):  # fmt: skip
        if tls is None and not is_loopback(host) and not insecure:
            from diloco_jax.learners.service import plaintext_refusal

            raise ValueError(plaintext_refusal(host, "the syncer's status page"))
        if mutual and tls is None:
            raise ValueError("syncer.mutual_tls needs TLS: set syncer.credentials")
        self.failures = identity.Failures(syncer.event) if failures is None else failures
        self._answerer = self._handler(secret, mutual, *_registry(syncer))
        self._context = None if tls is None else _context(tls, mutual)
        self.timeout, self.max_open = timeout, max_open
        self.closed: collections.Counter[str] = collections.Counter()  # closings by reason
        self.errors = 0  # requests that failed on the page's own fault (logged)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._waiting: dict[_Conn, None] = {}  # accepted, request not read yet: oldest first
        self._open, self._lock, self._stopping = 0, threading.Lock(), False
        self._workers = futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="syncer-status")
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="syncer-status")  # fmt: skip

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._thread.join()
        for conn in list(self._waiting):
            self._drop(conn, "stopped")
        self._selector.close()
        self._listener.close()
        self._workers.shutdown(wait=True)

    def _handler(self, secret: str, mutual: bool, registry: CollectorRegistry,
                 update: Callable[[], dict]) -> Callable[[_Conn], object]:  # fmt: skip
        """The class that answers one request whose head has been read: the operator's credential
        (and, with ``mutual``, certificate) or a 401, counted in :attr:`failures`."""
        failures = self.failures

        class Handler(BaseHTTPRequestHandler):
            def version_string(self) -> str:  # no Python version for a prober
                return "diloco-jax"

            def __init__(self, conn: _Conn):  # http.server's machinery without its socket reads
                self.request = self.connection = conn.sock
                self.client_address = (conn.peer, 0)
                self.rfile, self.wfile = io.BytesIO(bytes(conn.head)), conn.sock.makefile("wb")
                try:
                    self.handle()
                finally:
                    self.wfile.close()

            def log_message(self, format, *args):  # noqa: A002 - the base class's name
                log.debug("syncer status page: %s %s", self.client_address[0],
                          identity.printable(format % args))  # fmt: skip

            def _send(self, code: int, body: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server's name
                given = self.headers.get("Authorization", "").removeprefix("Bearer ")
                who = identity.identify(secret, given)
                if mutual and _common_name(self.connection) != identity.OPERATOR:
                    who = None  # the operator's credential on another party's certificate
                if who is None or who.kind != identity.OPERATOR:
                    failures.failed(self.client_address[0], "a wrong credential on the status page")
                    return self._send(401, b'{"error": "the operator\'s credential is needed"}',
                                      "application/json")  # fmt: skip
                path = self.path.split("?")[0]
                if path == "/metrics":
                    update()
                    return self._send(200, generate_latest(registry), "text/plain; version=0.0.4")
                if path == "/status":
                    return self._send(200, json.dumps(update()).encode(), "application/json")
                if path == "/":
                    return self._send(200, page(update()).encode(), "text/html; charset=utf-8")
                return self._send(404, b'{"error": "not found"}', "application/json")

        return Handler

    def _serve(self) -> None:
        """The serving thread: accepts, moves connections on, closes the expired ones."""
        while not self._stopping:
            try:
                for key, _ in self._selector.select(POLL):
                    if key.data is None:
                        self._accept()
                    elif key.data in self._waiting:  # not dropped by an earlier event
                        self._step(key.data)
                now = time.monotonic()
                while self._waiting and next(iter(self._waiting)).deadline <= now:
                    self._drop(next(iter(self._waiting)), "idle or slow")
            except Exception as e:  # noqa: BLE001 - the page's own fault: it goes on serving
                self._failed(e)

    def _accept(self) -> None:
        """Takes every connection waiting at the port; when ``max_open`` are open, makes room
        (:meth:`_evict`), or closes the new one when every open one is being answered."""
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: make room, or leave it in the backlog
                self._say(f"accept: {e.strerror or e}", "")
                self._evict() if self._waiting else time.sleep(POLL)
                return
            with self._lock:
                full = self._open >= self.max_open
            if full and self._waiting:
                self._evict()
            elif full:
                sock.close()
                self._say("full", address[0])
                continue
            with self._lock:
                self._open += 1
            sock.setblocking(False)
            conn = _Conn(sock, address[0], time.monotonic() + self.timeout,
                         ready=self._context is None)  # fmt: skip
            self._waiting[conn] = None
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _evict(self) -> None:
        """Closes the oldest connection that has not sent its request of the address that has
        the most such: a flood of idle connections evicts its own, not the operator's."""
        flood = collections.Counter(c.peer for c in self._waiting).most_common(1)[0][0]
        self._drop(next(c for c in self._waiting if c.peer == flood), "evicted")

    def _step(self, conn: _Conn) -> None:
        """Moves ``conn`` on as far as the bytes it has sent allow (TLS or not, the handshake,
        the request head), never waiting; a complete head goes to a worker."""
        try:
            if not conn.ready:
                self._handshake(conn)
            while not conn.complete():
                chunk = conn.sock.recv(4096)
                if not chunk:
                    return self._drop(conn, "disconnected")
                conn.head += chunk
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            return
        except ssl.SSLWantWriteError:  # the handshake's answer did not fit the socket's buffer
            self._selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return
        except OSError as e:  # ssl.SSLError included
            return self._drop(conn, _reason(e))
        del self._waiting[conn]
        self._selector.unregister(conn.sock)
        if conn.refusal is None and len(conn.head) > MAX_HEAD:
            conn.refusal = TOO_LARGE
        self._workers.submit(self._answer, conn)

    def _handshake(self, conn: _Conn) -> None:
        """TLS for ``conn`` once its first byte is a TLS record's (plain HTTP on the HTTPS port
        is read and answered 400 in clear, not torn into an SSL error), as far as it goes."""
        assert self._context is not None
        if not isinstance(conn.sock, ssl.SSLSocket):
            first = conn.sock.recv(1, socket.MSG_PEEK)
            if first != b"\x16":  # a TLS handshake record's type; nothing: the peer left
                conn.ready, conn.refusal = True, PLAIN_ON_TLS
                return
            self._selector.unregister(conn.sock)
            conn.sock = self._context.wrap_socket(conn.sock, server_side=True,
                                                  do_handshake_on_connect=False)  # fmt: skip
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        conn.sock.do_handshake()
        conn.ready = True
        self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _answer(self, conn: _Conn) -> None:
        """Answers ``conn``'s request in a worker, each write within ``timeout``; closes it."""
        try:
            conn.sock.settimeout(self.timeout)
            if conn.refusal is not None:
                conn.sock.sendall(conn.refusal)
            else:
                self._answerer(conn)
        except OSError as e:  # the client went away, or reads too slowly
            self._say(_reason(e), conn.peer)
        except Exception as e:  # noqa: BLE001 - the page's own fault: a line, the syncer goes on
            self._failed(e)
        finally:
            self._close(conn)

    def _failed(self, e: Exception) -> None:
        self.errors += 1  # a traceback for the first few: a fault of the page's own
        log.error("syncer status page: %s: %s", type(e).__name__, identity.printable(str(e)),
                  exc_info=self.errors <= 3)  # fmt: skip

    def _drop(self, conn: _Conn, why: str) -> None:
        """Closes ``conn`` before its request was answered (the serving thread's), counted."""
        self._waiting.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):  # a TLS wrapping that failed half-way
            self._selector.unregister(conn.sock)
        self._close(conn)
        self._say(why, conn.peer)

    def _close(self, conn: _Conn) -> None:
        conn.sock.close()
        with self._lock:
            self._open -= 1

    def _say(self, why: str, peer: str) -> None:
        """Counts a closing by ``why``: a debug line, a warning at counts 1, 2, 4, ... for
        those that say the page is flooded (:data:`LOUD`)."""
        with self._lock:
            self.closed[why] += 1
            n = self.closed[why]
        level = logging.WARNING if why in LOUD and n & (n - 1) == 0 else logging.DEBUG
        log.log(level, "syncer status page: closed a connection from %s: %s (%d so far)",
                identity.printable(peer), why, n)  # fmt: skip


def _context(tls, mutual: bool) -> ssl.SSLContext:
    """The page's TLS: the syncer's certificate; with ``mutual``, a client's of the run's CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_verify_locations(cadata=tls.ca.decode())
    if mutual:
        context.verify_mode = ssl.CERT_REQUIRED
    _load_chain(context, tls)
    return context


def _load_chain(context: ssl.SSLContext, tls) -> None:
    """``tls``'s certificate and key into ``context`` (the ssl module reads files only)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        cert, key = pathlib.Path(folder) / "cert.pem", pathlib.Path(folder) / "key.pem"
        cert.write_bytes(tls.cert)
        key.touch(0o600)
        key.write_bytes(tls.key)
        context.load_cert_chain(cert, key)
