"""The syncer's status over HTTP (``syncer.status_port``): ``/`` a page a person reads,
``/status`` the same as JSON, ``/metrics`` for Prometheus. Every read needs the operator's
credential (``Authorization: Bearer CREDENTIAL``, :func:`.identity.operator_credential`), on
loopback too; a learner's is refused. With the syncer's certificate the page is HTTPS; off
loopback it must be, unless ``insecure``."""

from __future__ import annotations

import html
import json
import pathlib
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from diloco_jax.base.access import is_loopback
from diloco_jax.learners import identity
from diloco_jax.learners.syncer import Syncer

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


class StatusServer:
    """Serves ``syncer``'s status at ``host:port`` in a thread (0: a free port); ``secret``:
    the run's (the operator's credential is derived from it); ``tls``: the syncer's
    :class:`~.certs.Tls` (None: plain HTTP, refused off loopback unless ``insecure``)."""

    def __init__(self, syncer: Syncer, host: str, port: int, *, secret: str, tls=None,
                 insecure: bool = False):  # fmt: skip
        if tls is None and not is_loopback(host) and not insecure:
            from diloco_jax.learners.service import plaintext_refusal

            raise ValueError(plaintext_refusal(host, "the syncer's status page"))
        registry, update = _registry(syncer)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format, *args):  # noqa: A002 - the base class's name
                pass

            def _send(self, code: int, body: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server's name
                given = self.headers.get("Authorization", "").removeprefix("Bearer ")
                who = identity.identify(secret, given)
                if who is None or who.kind != identity.OPERATOR:
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

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_verify_locations(cadata=tls.ca.decode())
            _load_chain(context, tls)
            # the handshake in each request's thread, on its first read: a client that never
            # speaks holds up its own thread, not the accepting one
            self._httpd.socket = context.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="syncer-status")  # fmt: skip

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _load_chain(context: ssl.SSLContext, tls) -> None:
    """``tls``'s certificate and key into ``context`` (the ssl module reads files only)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        cert, key = pathlib.Path(folder) / "cert.pem", pathlib.Path(folder) / "key.pem"
        cert.write_bytes(tls.cert)
        key.touch(0o600)
        key.write_bytes(tls.key)
        context.load_cert_chain(cert, key)
