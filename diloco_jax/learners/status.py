"""The syncer's status over HTTP (``syncer.status_port``): ``/`` a page a person reads in a
browser (the rounds, the learners and their losses, bytes, waits, late and refused pushes, with
charts over the last rounds: :mod:`.view`), ``/status`` as JSON, ``/history`` the last rounds'
series as JSON, ``/metrics`` for Prometheus. Every read needs the operator: its credential
(``Authorization: Bearer CREDENTIAL``, :func:`.identity.operator_credential`), on loopback too,
or a browser's session (:mod:`.sessions`), opened by the sign-in form of ``/login`` or by a
one-time link (:meth:`StatusServer.link`: the syncer logs one as it starts); anything else is
refused at once and counted per address (:class:`.identity.Failures`). Who may read what, and
each path's answer, is :mod:`.answering`'s. With the syncer's certificate the page is HTTPS
(with ``mutual``, the operator's client certificate is needed too, whatever else is shown); off
loopback it must be, unless ``insecure``.

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
import logging
import pathlib
import selectors
import socket
import ssl
import threading
import time
from concurrent import futures

from diloco_jax.base.access import is_loopback
from diloco_jax.learners import answering, identity
from diloco_jax.learners.sessions import Sessions
from diloco_jax.learners.syncer import Syncer

log = logging.getLogger("diloco_jax")
MAX_OPEN = 32  # connections open at once: the gRPC port's learners need descriptors too
WORKERS = 4  # requests answered at once (an answer is a few kilobytes, written in milliseconds)
MAX_HEAD = 8192  # bytes of request line and headers (a browser's or curl's are under 2 KiB)
TIMEOUT = 5.0  # seconds a connection has to send its request, and each write to take
POLL = 0.1  # seconds between the serving thread's looks at deadlines and stop()
LOUD = ("full", "evicted")  # closings that say the page is flooded: warned at counts 1, 2, 4, ...


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
    credentials are counted (default: a count of the page's own, into the syncer's tape);
    ``sessions``: the browsers' sessions and one-time links (a test's, on its own clock)."""

    def __init__(self, syncer: Syncer, host: str, port: int, *, secret: str, tls=None,
                 mutual: bool = False, insecure: bool = False, timeout: float = TIMEOUT,
                 max_open: int = MAX_OPEN, failures: identity.Failures | None = None,
                 sessions: Sessions | None = None):  # fmt: skip
        if tls is None and not is_loopback(host) and not insecure:
            from diloco_jax.learners.service import plaintext_refusal

            raise ValueError(plaintext_refusal(host, "the syncer's status page"))
        if mutual and tls is None:
            raise ValueError("syncer.mutual_tls needs TLS: set syncer.credentials")
        self.failures = identity.Failures(syncer.event) if failures is None else failures
        self.sessions = Sessions() if sessions is None else sessions
        self._context = None if tls is None else _context(tls, mutual)
        self.timeout, self.max_open = timeout, max_open
        self.closed: collections.Counter[str] = collections.Counter()  # closings by reason
        self.errors = 0  # requests that failed on the page's own fault (logged)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._answerer = answering.handler(syncer, secret=secret, mutual=mutual,
                                           failures=self.failures, sessions=self.sessions,
                                           port=self.port, secure=tls is not None)  # fmt: skip
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

    def link(self, address: str) -> str:
        """A new one-time link to the page at ``address`` (``https://HOST:PORT``): it signs a
        browser in once, within :data:`.sessions.LINK_SECONDS`."""
        return f"{address}/login?once={self.sessions.link()}"

    def stop(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._thread.join()
        for conn in list(self._waiting):
            self._drop(conn, "stopped")
        self._selector.close()
        self._listener.close()
        self._workers.shutdown(wait=True)

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
                self._answerer(conn.sock, conn.peer, bytes(conn.head))
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
