"""See and steer a running job over HTTP: ``/status``, ``/metrics``, the dashboard, ``/control``.

``serve.port > 0`` starts a :class:`Server` in the training process (process 0 of a multi-process
run), in its own threads: the training loop only hands it copies of what it reports
(:class:`~diloco_jax.watch.board.Board`) and reads the actions asked of it at call boundaries
(:class:`~diloco_jax.watch.board.Controls`), so a client, however slow, never holds up a step.

* ``GET /status``: JSON: step, outer step, losses, per-replica sync diagnostics, throughput, last
  checkpoint, ETA, the resolved config. ``GET /history``: every point the charts draw.
* ``GET /metrics``: Prometheus text exposition (``prometheus_client``), labelled by replica.
* ``GET /``: the dashboard (``diloco_jax/watch/dashboard/``, served from the installed package).
* ``POST /control/checkpoint|stop|eval``: done at the next call boundary (agreed by every
  process, as the preemption flag is); ``POST /control/outer_lr`` with ``{"value": 0.35}``:
  DiLoCo's outer learning rate from the next sync on (:mod:`diloco_jax.run.live`).

Security: binds 127.0.0.1 unless ``serve.host`` says otherwise; another address needs a token
(``serve.token`` or the ``DILOCO_SERVE_TOKEN`` environment variable), and then every request
needs it. Control requests always need it (``Authorization: Bearer TOKEN``, compared in constant
time): without a configured one a random token is written to ``WORKDIR/serve_token`` (mode 600).
A wrong or missing token is 401, a malformed body or value 400, a body over
:data:`MAX_BODY` bytes 413; none of these changes anything. The server executes nothing it
receives: an action is one of a fixed set of names with a number.
"""

from __future__ import annotations

import hmac
import http.server
import importlib.resources
import json
import math
import os
import pathlib
import secrets
import sys
import threading
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from diloco_jax.base.access import TOKEN_ENV, is_loopback
from diloco_jax.watch.board import Board, Controls, SweepBoard
from diloco_jax.watch.reporting import log

MAX_BODY = 4096  # bytes of a control request's body
ACTIONS = ("checkpoint", "stop", "eval", "outer_lr")
_ASSETS = {"/": ("index.html", "text/html; charset=utf-8"),
           "/chart.js": ("chart.js", "text/javascript; charset=utf-8"),  # the syncer's page too
           "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8")}  # fmt: skip


def _finite_positive(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)  # fmt: skip


def resolve_token(token_file: str, workdir: pathlib.Path, environ=os.environ) -> tuple[str, bool]:
    """``(token, generated)``: the contents of ``token_file``, else ``$DILOCO_SERVE_TOKEN``,
    else a new random one written to ``workdir/serve_token`` (readable by this user only)."""
    token = pathlib.Path(token_file).read_text().strip() if token_file else ""
    token = token or environ.get(TOKEN_ENV, "")
    if token:
        return token, False
    token = secrets.token_urlsafe(24)
    path = workdir / "serve_token"
    workdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Server
    timeout = 10  # seconds a client may stall on one request before its thread gives up
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        del format, args  # requests are not logged: the run's log is for training

    def _send(self, code: int, body: bytes | str, content_type: str = "application/json"):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, reason: str) -> None:
        self._send(code, json.dumps({"error": reason}) + "\n")

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        given = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        return hmac.compare_digest(given.encode(), self.server.token.encode())

    def do_GET(self):  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if self.server.read_needs_token and not self._authorized():
            return self._error(401, "missing or wrong token (Authorization: Bearer TOKEN)")
        board, controls = self.server.board, self.server.controls
        if path == "/status":
            status = board.snapshot(controls.pending())
            if self.server.sweep is not None:
                status["sweep"] = self.server.sweep.snapshot()
            return self._send(200, json.dumps(status, allow_nan=False))
        if path == "/history":
            return self._send(200, json.dumps(board.series(), allow_nan=False))
        if path == "/metrics":
            return self._send(200, generate_latest(board.registry), CONTENT_TYPE_LATEST)
        if path in _ASSETS:
            name, kind = _ASSETS[path]
            text = importlib.resources.files("diloco_jax.watch").joinpath("dashboard", name)
            return self._send(200, text.read_bytes(), kind)
        return self._error(404, f"no page {path}")

    def _body(self) -> dict | None:
        """The request's JSON object (empty body: ``{}``); None after answering an error."""
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self._error(400, "Content-Length is not a number")
            return None
        if length > MAX_BODY:
            self._error(413, f"a control request's body is at most {MAX_BODY} bytes")
            return None
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            self._error(400, "the body is not JSON")
            return None
        if not isinstance(body, dict):
            self._error(400, "the body must be a JSON object")
            return None
        return body

    def do_POST(self):  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        if not path.startswith("/control/"):
            return self._error(404, f"no page {path}")
        if not self._authorized():
            return self._error(401, "missing or wrong token (Authorization: Bearer TOKEN)")
        action = path[len("/control/") :]
        body = self._body()
        if body is None:
            return None
        if action not in ACTIONS:
            return self._error(404, f"no control {action!r}; one of {ACTIONS}")
        value: object = True
        if action == "outer_lr":
            value = body.get("value")
            if not self.server.board.has_outer_lr:
                return self._error(400, "this run has no outer learning rate (not DiLoCo)")
            if not _finite_positive(value):
                return self._error(400, 'send {"value": x} with x a finite number > 0')
        self.server.controls.ask(action, value)
        return self._send(202, json.dumps({"accepted": action, "value": value,
                                           "at": "the next call boundary"}))  # fmt: skip


class Server(http.server.ThreadingHTTPServer):
    """The HTTP server of one run, or of a sweep (``sweep``: its :class:`SweepBoard`; ``board``
    then changes to each run's as it starts). :meth:`start` runs it in a daemon thread."""

    daemon_threads = True  # a stalled client's thread never keeps the process alive

    def __init__(self, host: str, port: int, *, board: Board, controls: Controls, token: str):
        if not is_loopback(host) and not token:
            raise ValueError(f"serving on {host} needs a token (serve.token or ${TOKEN_ENV})")
        self.board, self.controls, self.token = board, controls, token
        self.sweep: SweepBoard | None = None
        self.read_needs_token = not is_loopback(host)
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def handle_error(self, request, client_address) -> None:
        """A client that went away or stalled past the timeout is no news; anything else is one
        warning line, and the server goes on."""
        error = sys.exc_info()[1]
        if not isinstance(error, ConnectionError | TimeoutError):
            log.warning("serve: a request from %s failed: %s: %s", client_address[0],
                        type(error).__name__, error)  # fmt: skip

    def start(self) -> threading.Thread:
        # polled every 50 ms (the library's default is 0.5 s), so ``stop`` returns at once and
        # a run's end does not wait on its server
        thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                  name="diloco-serve", daemon=True)  # fmt: skip
        thread.start()
        return thread

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
