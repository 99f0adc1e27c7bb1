"""What the syncer's status page shows (:mod:`.status` serves it): the Prometheus gauges of
``/metrics``, the summary of ``/`` (the rounds, the learners' table with their losses, bytes,
waits, late and refused pushes) as HTML, and the page's files (``learners/page/``: the page,
the sign-in form, their scripts and style; the charts are the run dashboard's own
``watch/dashboard/chart.js``)."""

from __future__ import annotations

import html
import importlib.resources
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from diloco_jax.learners.syncer import Syncer

STATUSES = ("present", "dropped", "left", "removed")
HTML = "text/html; charset=utf-8"
JS = "text/javascript; charset=utf-8"
# the page's files by path: (package, file under its folder, content type); none holds a secret
ASSETS = {
    "/page.js": ("learners", "page/page.js", JS),
    "/login.js": ("learners", "page/login.js", JS),
    "/page.css": ("learners", "page/page.css", "text/css; charset=utf-8"),
    "/chart.js": ("watch", "dashboard/chart.js", JS),  # the run dashboard's charts
}


def _read(package: str, name: str) -> bytes:
    return importlib.resources.files(f"diloco_jax.{package}").joinpath(name).read_bytes()


def asset(path: str) -> tuple[bytes, str]:
    """``(bytes, content type)`` of the page's file at ``path`` (a key of :data:`ASSETS`)."""
    package, name, kind = ASSETS[path]
    return _read(package, name), kind


def page(st: dict) -> bytes:
    """``/``: the page, its summary (:func:`summary`) filled in; its script keeps it fresh."""
    text = _read("learners", "page/index.html").decode()
    return text.replace("<!--summary-->", summary(st)).encode()


def login_page(note: str = "") -> bytes:
    """``/login``: the sign-in form, with ``note`` (why the browser is there) above it."""
    text = _read("learners", "page/login.html").decode()
    return text.replace("<!--note-->", html.escape(note)).encode()


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def summary(st: dict) -> str:
    """The status (:meth:`~.syncer.Syncer.status`) as HTML: the facts of the rounds, then a
    row per learner (its status as the row's class)."""
    members = st["members"].values()
    grace = f", grace {st['grace_in_force']} s (at most {st['grace']} s)" if st["quorum"] else ""
    end = f" of {st['rounds']}" if st["rounds"] else ""
    facts = {
        "rounds closed": f"{st['round']}{end}" + (" (finished)" if st["finished"] else ""),
        "mode": f"{st['mode']}{grace}",
        "learners declared": st["learners"],
        "open round": f"{len(st['pending'])} pushes in, waiting for {st['waiting_for'] or '-'}",
        "bytes in": f"{st['bytes_in']:,}", "bytes out": f"{st['bytes_out']:,}",
        "rounds stood open": f"{st['waited_seconds']:.1f} s",
        "late pushes": sum(m["late"] for m in members), "refused pushes": st["refused"],
        "examples merged": f"{st['merged_examples']:,.0f}",
        "deadline": f"{st['timeout']} s after a round's first push",
        "dropped after": f"{st['dead_after']} s of silence",
    }  # fmt: skip
    if st.get("merge_rule", "mean") != "mean":
        facts["merge"] = st["merge_rule"]
    if st.get("removed"):
        facts["removed by the operator"] = ", ".join(map(str, st["removed"]))
    shown = "".join(f"<div><b>{k}</b>{html.escape(str(v))}</div>" for k, v in facts.items())
    rows = "".join(
        f'<tr class="{_row_class(m)}"><td>{i}</td><td>{html.escape(_status(m))}</td>'
        f"<td>{m['generation']}</td><td>{m['joined_round']}</td><td>{m['pushes']}</td>"
        f"<td>{m['late']}</td><td>{m['refused']}</td><td>{m.get('capped', 0)}</td>"
        f"<td>{_loss(m['loss'])}</td>{_merged(m.get('merge'))}</tr>"
        for i, m in st["members"].items()
    )
    return (
        f'<div class="facts" id="facts">{shown}</div>'
        '<table id="learners"><thead><tr><th>learner</th><th>status</th><th>generation</th>'
        "<th>joined at round</th><th>pushes</th><th>late</th><th>refused</th>"
        "<th>weight capped</th><th>training loss</th><th>push norm</th>"
        "<th>distance to merge</th><th>clipped / trimmed</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def _status(m: dict) -> str:
    return m["status"] + (", suspect" if m.get("suspect") else "")


def _row_class(m: dict) -> str:
    return html.escape(m["status"]) + (" suspect" if m.get("suspect") else "")


def _merged(shown: dict | None) -> str:
    """A learner's last merged push as a robust merge saw it (issue 63; None: no robust merge
    yet): three cells, its norm, its distance to the merged update, and clipped / the share
    of its coordinates trimmed."""
    if not shown:
        return "<td>-</td><td>-</td><td>-</td>"
    touched = "clipped" if shown["clipped"] else f"{100 * shown['trimmed']:.0f}% trimmed"
    return (f"<td>{shown['norm']:.4g}</td><td>{shown['distance']:.4g}</td>"
            f"<td>{html.escape(touched)}</td>")  # fmt: skip


def registry(syncer: Syncer) -> tuple[CollectorRegistry, Callable[[], dict]]:
    """``/metrics``' registry and the function that sets its gauges from the syncer's status
    (and returns that status)."""
    registry = CollectorRegistry()

    def gauge(name: str, text: str, *labels: str) -> Gauge:
        return Gauge(f"diloco_syncer_{name}", text, list(labels), registry=registry)

    gauges = {
        "round": gauge("round", "rounds closed"),
        "learners": gauge("learners", "learners by status", "status"),
        "pending": gauge("pending_pushes", "pushes in the open round"),
        "bytes_in": gauge("bytes_in", "array bytes received"),
        "bytes_out": gauge("bytes_out", "array bytes sent"),
        "waited": gauge("waited_seconds", "seconds rounds stood open"),
        "timeout": gauge("round_timeout_seconds", "a round's deadline after its first push"),
        "quorum": gauge("quorum", "pushes a round needs (0: every learner)"),
        "grace": gauge("grace_seconds", "the grace window in force after a quorum"),
        "late": gauge("late_pushes", "pushes merged into a later round"),
        "refused": gauge("refused_pushes", "pushes refused (stale, conflict, out of range)"),
        "loss": gauge("learner_loss", "a learner's last push's training loss", "learner"),
        "capped": gauge(
            "learner_capped_pushes", "a learner's pushes whose weight was capped", "learner"
        ),  # fmt: skip
        "norm": gauge(
            "learner_push_norm", "a robust merge: a learner's last push's norm", "learner"
        ),  # fmt: skip
        "distance": gauge(
            "learner_push_distance",
            "a robust merge: a learner's last push's distance to the merged update",
            "learner",
        ),  # fmt: skip
        "outlier": gauge(
            "learner_outlier",
            "a robust merge: 1 where a learner's last push was clipped, trimmed or far",
            "learner",
        ),  # fmt: skip
        "suspect": gauge(
            "learner_suspect", "1: an outlier of the merge in most of its last rounds", "learner"
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
        gauges["refused"].set(st["refused"])
        for i, m in st["members"].items():
            if m["loss"] is not None:
                gauges["loss"].labels(str(i)).set(m["loss"])
            gauges["capped"].labels(str(i)).set(m.get("capped", 0))
            gauges["suspect"].labels(str(i)).set(float(bool(m.get("suspect"))))
            shown = m.get("merge")
            if shown:
                gauges["norm"].labels(str(i)).set(shown["norm"])
                gauges["distance"].labels(str(i)).set(shown["distance"])
                gauges["outlier"].labels(str(i)).set(float(bool(shown["outlier"])))
        return st

    return registry, update
