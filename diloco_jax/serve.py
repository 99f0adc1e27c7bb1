"""See and steer a running job over HTTP: ``/status``, ``/metrics``, the dashboard, ``/control``.

``serve.port > 0`` starts a :class:`Server` in the training process (process 0 of a multi-process
run), in its own threads: the training loop only hands it copies of what it reports
(:class:`Board`) and reads the actions asked of it at call boundaries (:class:`Controls`), so a
client, however slow, never holds up a step.

* ``GET /status``: JSON: step, outer step, losses, per-replica sync diagnostics, throughput, last
  checkpoint, ETA, the resolved config. ``GET /history``: every point the charts draw.
* ``GET /metrics``: Prometheus text exposition (``prometheus_client``), labelled by replica.
* ``GET /``: the dashboard (``diloco_jax/dashboard/``, served from the installed package).
* ``POST /control/checkpoint|stop|eval``: done at the next call boundary (agreed by every
  process, as the preemption flag is); ``POST /control/outer_lr`` with ``{"value": 0.35}``:
  DiLoCo's outer learning rate from the next sync on (:mod:`diloco_jax.live`).

Security: binds 127.0.0.1 unless ``serve.host`` says otherwise; another address needs a token
(``serve.token`` or the ``DILOCO_SERVE_TOKEN`` environment variable), and then every request
needs it. Control requests always need it (``Authorization: Bearer TOKEN``, compared in constant
time): without a configured one a random token is written to ``WORKDIR/serve_token`` (mode 600).
A wrong or missing token is 401, a malformed body or value 400, a body over
:data:`MAX_BODY` bytes 413; none of these changes anything. The server executes nothing it
receives: an action is one of a fixed set of names with a number.
"""

from __future__ import annotations

import collections
import hmac
import http.server
import importlib.resources
import ipaddress
import json
import math
import os
import pathlib
import secrets
import sys
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from diloco_jax.reporting import log

TOKEN_ENV = "DILOCO_SERVE_TOKEN"
MAX_BODY = 4096  # bytes of a control request's body
MAX_POINTS = 4000  # per chart series; older points are thinned, never the newest
ACTIONS = ("checkpoint", "stop", "eval", "outer_lr")
_ASSETS = {"/": ("index.html", "text/html; charset=utf-8"),
           "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8")}  # fmt: skip


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts connections from this
    machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Controls:
    """The actions asked over HTTP, waiting for the next call boundary (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[str, Any] = {}

    def ask(self, action: str, value: Any = True) -> None:
        with self._lock:
            self._pending[action] = value

    def pending(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._pending)

    def take(self) -> dict[str, Any]:
        """The actions asked since the last call, cleared."""
        with self._lock:
            out, self._pending = self._pending, {}
        return out


def _thin(points: collections.deque) -> None:
    """Halves a full series, keeping every other old point and the newest."""
    if len(points) >= MAX_POINTS:
        kept = list(points)[::2]
        points.clear()
        points.extend(kept)


class Board:
    """What the run has reported, for the server: the latest status, the chart series and the
    Prometheus metrics. :meth:`event` takes each ``metrics.jsonl`` record (from the training
    thread); the readers take copies under the lock."""

    def __init__(self, *, config: dict, total_steps: int, replicas: int, unit: str,
                 tokens_per_step: int, bytes_per_sync: float = 0.0,
                 outer_lr: float | None = None):  # fmt: skip
        self._lock = threading.Lock()
        self._started = time.time()
        self.tokens_per_step, self.bytes_per_sync = tokens_per_step, bytes_per_sync
        self.status: dict[str, Any] = {
            "state": "starting", "step": 0, "total_steps": total_steps, "outer_step": 0,
            "replicas": replicas, "unit": unit, "train_loss": None, "eval_loss": None,
            "tokens": 0, "tokens_per_s": None, "bytes_sent_per_replica": 0.0,
            "last_checkpoint": None, "eta_s": None, "replica_state": [], "replica_loss": [],
            "controls": [], "outer_lr": outer_lr, "config": config,
        }  # fmt: skip
        self.history = {name: collections.deque() for name in ("train", "eval", "sync")}
        self.registry = CollectorRegistry()
        self._metrics = _prometheus(self.registry)
        self.has_outer_lr = outer_lr is not None  # only DiLoCo has one
        if self.has_outer_lr:
            self._metrics["outer_lr"].set(outer_lr)

    def event(self, record: dict) -> None:
        """One ``metrics.jsonl`` record (``event``, ``step`` and its values)."""
        kind, step = record["event"], record["step"]
        with self._lock:
            handler = getattr(self, f"_on_{kind}", None)
            if handler is not None:
                handler(step, record)

    def _on_train(self, step: int, r: dict) -> None:
        m, previous = self._metrics, self.status["step"]
        tokens = step * self.tokens_per_step
        self.status["replica_loss"] = list(r["replica_loss"])
        self.status.update(step=step, train_loss=r["loss"], tokens=tokens,
                           tokens_per_s=r["tokens_per_s"], outer_step=r["outer_steps"],
                           state="running")  # fmt: skip
        left = self.status["total_steps"] - step
        rate = r["tokens_per_s"] / self.tokens_per_step if r["tokens_per_s"] else 0
        self.status["eta_s"] = left / rate if rate > 0 else None
        _thin(self.history["train"])
        self.history["train"].append([step, tokens, r["loss"], r["tokens_per_s"]])
        m["steps"].inc(max(step - previous, 0))
        m["tokens"].inc(max(step - previous, 0) * self.tokens_per_step)
        m["train_loss"].set(r["loss"])
        m["tokens_per_s"].set(r["tokens_per_s"])
        for i, loss in enumerate(r["replica_loss"]):
            m["replica_loss"].labels(replica=str(i)).set(loss)

    def _on_eval(self, step: int, r: dict) -> None:
        self.status["eval_loss"] = r["eval_loss"]
        _thin(self.history["eval"])
        self.history["eval"].append([step, step * self.tokens_per_step, r["eval_loss"]])
        self._metrics["eval_loss"].set(r["eval_loss"])

    def _on_sync(self, step: int, r: dict) -> None:
        m = self._metrics
        rows = []
        per_replica = zip(r["drift"], r["cosine_to_mean"], r["weight"], r["finite"], strict=True)
        for i, (drift, cosine, weight, finite) in enumerate(per_replica):
            status = "contributed" if weight > 0 else ("non-finite" if not finite else "left out")
            rows.append({"replica": i, "drift": drift, "cosine": cosine, "weight": weight,
                         "status": status})  # fmt: skip
            m["drift"].labels(replica=str(i)).set(drift)
            m["cosine"].labels(replica=str(i)).set(cosine)
        self.status["replica_state"] = rows
        self.status["bytes_sent_per_replica"] += self.bytes_per_sync
        _thin(self.history["sync"])
        self.history["sync"].append([r["outer_step"], step, list(r["drift"]),
                                     list(r["cosine_to_mean"]), list(r["weight"])])  # fmt: skip
        m["syncs"].inc()
        m["bytes"].inc(self.bytes_per_sync)
        m["contributors"].set(r["contributors"])

    def _on_checkpoint(self, step: int, r: dict) -> None:
        self.status["last_checkpoint"] = step
        self._metrics["checkpoints"].inc()

    def _on_control(self, step: int, r: dict) -> None:
        done = [{"step": step, "action": a} for a in r["actions"]]
        self.status["controls"] = [*self.status["controls"], *done][-20:]
        if "outer_lr" in r:
            self.status["outer_lr"] = r["outer_lr"]
            self._metrics["outer_lr"].set(r["outer_lr"])

    def _on_done(self, step: int, r: dict) -> None:
        self.status.update(state="stopped" if r.get("preempted") else "done", eta_s=0.0)

    def snapshot(self, pending: dict | None = None) -> dict:
        """The status (a copy, JSON-ready: NaN and infinities as None)."""
        with self._lock:
            out = _json_ready(self.status)
        out["elapsed_s"] = round(time.time() - self._started, 1)
        out["pending_controls"] = sorted(pending or {})
        return out

    def series(self) -> dict:
        """The chart series (a copy, JSON-ready)."""
        with self._lock:
            return _json_ready({name: list(points) for name, points in self.history.items()})


def _finite_positive(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)  # fmt: skip


def _json_ready(value: Any) -> Any:
    """A deep copy of ``value`` that strict JSON can hold: a non-finite float becomes None
    (JavaScript's JSON.parse rejects NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    return value


class SweepBoard:
    """A sweep's progress for ``/status`` (``sweep``): each run's state (pending, running,
    done) and final loss, and the sweep's table rows so far (thread-safe)."""

    def __init__(self, names: list[str]):
        self._lock = threading.Lock()
        self._runs = {name: {"run": name, "state": "pending", "final_eval_loss": None}
                      for name in names}  # fmt: skip
        self._rows: list[dict] = []

    def started(self, name: str) -> None:
        with self._lock:
            self._runs[name]["state"] = "running"

    def finished(self, name: str, row: dict) -> None:
        """Run ``name`` is done; ``row`` is its line of the sweep's results."""
        with self._lock:
            self._runs[name].update(state="done", final_eval_loss=row["final_eval_loss"])
            self._rows.append(dict(row))

    def snapshot(self) -> dict:
        with self._lock:
            return _json_ready({"runs": list(self._runs.values()), "table": self._rows})


def _prometheus(registry: CollectorRegistry) -> dict:
    def counter(name, about):
        return Counter(f"diloco_{name}", about, registry=registry)

    def gauge(name, about, *labels):
        return Gauge(f"diloco_{name}", about, labels, registry=registry)

    return {
        "steps": counter("inner_steps", "inner steps taken per replica"),
        "tokens": counter("tokens", "tokens (or examples) trained on, all replicas"),
        "syncs": counter("syncs", "DiLoCo syncs started"),
        "bytes": counter("sent_bytes", "bytes each replica sent in syncs (ring all-reduce)"),
        "checkpoints": counter("checkpoints", "checkpoints saved"),
        "train_loss": gauge("train_loss", "mean training loss of the last step"),
        "eval_loss": gauge("eval_loss", "last evaluation loss of the outer parameters"),
        "tokens_per_s": gauge("tokens_per_second", "training throughput, all replicas"),
        "contributors": gauge("contributors", "replicas in the last sync's mean"),
        "outer_lr": gauge("outer_learning_rate", "DiLoCo's outer learning rate in effect"),
        "replica_loss": gauge("replica_train_loss", "training loss", "replica"),
        "drift": gauge("replica_drift", "|anchor - params| at the last sync", "replica"),
        "cosine": gauge(
            "replica_cosine_to_mean", "pseudo-gradient's cosine to the mean", "replica"
        ),
    }


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
            text = importlib.resources.files("diloco_jax").joinpath("dashboard", name)
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
        value = True
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
        thread = threading.Thread(target=self.serve_forever, name="diloco-serve", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
