"""What a run reports to its HTTP server (:mod:`diloco_jax.watch.serve`), kept for the server's
threads: :class:`Board` (the status, the chart series, the Prometheus metrics), :class:`SweepBoard`
(a sweep's runs and table) and :class:`Controls` (the actions asked, waiting for a call
boundary). Each is thread-safe: the training thread writes, the server's threads take copies."""

from __future__ import annotations

import collections
import json
import math
import pathlib
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from diloco_jax.watch.reporting import eval_metrics

MAX_POINTS = 4000  # per chart series; older points are thinned, never the newest


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
            "aux": {}, "eval_metrics": {},  # a loss's auxiliary metrics; the eval's others
        }  # fmt: skip
        # train: [step, tokens, loss, tokens/s]; eval: [step, tokens, eval_loss]; sync: see
        # _on_sync; metrics: [step, tokens, {"aux name" | "eval name": value}] (a loss's
        # auxiliary metrics and the evaluation's other values)
        self.history: dict[str, collections.deque] = {
            name: collections.deque() for name in ("train", "eval", "sync", "metrics")
        }
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
        aux = {k.removeprefix("aux_"): v for k, v in r.items() if k.startswith("aux_")}
        self.status["aux"] = aux
        for name, value in aux.items():
            m["aux"].labels(name=name).set(value)
        if aux:
            _thin(self.history["metrics"])
            self.history["metrics"].append(
                [step, tokens, {f"train {k}": v for k, v in aux.items()}]
            )

    def _on_eval(self, step: int, r: dict) -> None:
        self.status["eval_loss"] = r["eval_loss"]
        _thin(self.history["eval"])
        self.history["eval"].append([step, step * self.tokens_per_step, r["eval_loss"]])
        self._metrics["eval_loss"].set(r["eval_loss"])
        others = eval_metrics(r)  # accuracy, ...
        self.status["eval_metrics"] = others
        for name, value in others.items():
            self._metrics["eval_metric"].labels(name=name).set(value)
        if others:
            _thin(self.history["metrics"])
            named = {f"eval {k}": v for k, v in others.items()}
            self.history["metrics"].append([step, step * self.tokens_per_step, named])

    def replay(self, path, up_to: int) -> int:
        """The events of ``path`` (a resumed run's ``metrics.jsonl``) up to step ``up_to``, as
        if they had just been written, so the charts start where the run did; returns how
        many. Records the run wrote past its checkpoint (before it died) are skipped: the
        resumed run writes them again."""
        count = 0
        try:
            lines = pathlib.Path(path).read_text().splitlines()
        except OSError:
            return 0
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut by a crash
                continue
            if record.get("step", up_to + 1) <= up_to and record.get("event") != "done":
                self.event(record)
                count += 1
        return count

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
        "aux": gauge("aux_metric", "a loss's auxiliary metric, replicas' mean", "name"),
        "eval_metric": gauge("eval_metric", "the evaluation's other metrics", "name"),
        "drift": gauge("replica_drift", "|anchor - params| at the last sync", "replica"),
        "cosine": gauge(
            "replica_cosine_to_mean", "pseudo-gradient's cosine to the mean", "replica"
        ),
    }
