"""Figures a run draws of itself, with matplotlib (the ``plots`` extra, imported only when a
figure is drawn): the sync diagnostics, drift and cosine against outer steps. The simulator's
own figures (``sim/plots.py``) draw with :func:`pyplot`; these draw on bare ``Figure`` objects,
so a run can draw them in a thread (:func:`draw_in_background`)."""

from __future__ import annotations

import json
import pathlib
import threading

import numpy as np

from diloco_jax import extras
from diloco_jax.reporting import log


def pyplot():
    """matplotlib's pyplot, drawing into files only (no display needed)."""
    matplotlib = extras.require("matplotlib", "drawing figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


DIAGNOSTICS = (("drift", "drift.png", "drift |anchor - params| at the sync"),
               ("cosine_to_mean", "cosine.png", "cosine to the mean pseudo-gradient"))  # fmt: skip


def sync_events(metrics_path: pathlib.Path) -> list[dict]:
    """The ``sync`` events of a run's ``metrics.jsonl`` (none for the baselines)."""
    if not metrics_path.exists():
        return []
    events = (json.loads(line) for line in metrics_path.read_text().splitlines() if line)
    return [e for e in events if e["event"] == "sync"]


def diagnostics(runs: dict[str, list[dict]], directory: pathlib.Path, *,
                per_replica: bool) -> list[str]:  # fmt: skip
    """``drift.png`` and ``cosine.png`` in ``directory``: the sync diagnostics against outer
    steps. ``runs[name]``: a run's :func:`sync_events`; ``per_replica``: one run, a line per
    replica; else a line per run, the mean over its replicas (NaN, a left-out replica's cosine,
    skipped). Returns the files written (none if no run synced)."""
    runs = {name: events for name, events in runs.items() if events}
    if not runs:
        return []
    extras.require("matplotlib", "drawing figures")
    from matplotlib.figure import Figure  # no pyplot: safe in a background thread

    for key, file, ylabel in DIAGNOSTICS:
        fig = Figure(figsize=(7, 4.5))
        ax = fig.add_subplot()
        for name, events in runs.items():
            outer = [e["outer_step"] for e in events]
            values_SxR = _rows(e[key] for e in events)
            if per_replica:
                for r in range(values_SxR.shape[1]):
                    ax.plot(outer, values_SxR[:, r], marker=".", label=f"replica {r}")
            else:
                ax.plot(outer, _nanmean_rows(values_SxR), marker=".", label=name)
        ax.set_xlabel("outer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(directory / file, dpi=120)
    return [file for _, file, _ in DIAGNOSTICS]


def _rows(lists) -> np.ndarray:
    """float ``[S, R]`` of per-replica lists (None as NaN), short ones padded with NaN: an
    elastic restart changes the replica count within a run."""
    lists = [[np.nan if v is None else v for v in values] for values in lists]
    width = max(len(values) for values in lists)
    return np.array([values + [np.nan] * (width - len(values)) for values in lists], float)


def _nanmean_rows(values_SxR: np.ndarray) -> np.ndarray:
    """Each row's mean over its finite entries (NaN where it has none)."""
    finite = np.isfinite(values_SxR)
    count = finite.sum(axis=1)
    total = np.where(finite, values_SxR, 0.0).sum(axis=1)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def run_diagnostics(workdir: pathlib.Path) -> list[str]:
    """A finished run's ``drift.png`` and ``cosine.png`` (a line per replica) in ``workdir``, if
    matplotlib is installed and the run synced; the files written. Never raises: a figure that
    cannot be drawn is a warning, not a failed run."""
    if extras.missing("matplotlib"):
        return []
    try:
        return diagnostics({"run": sync_events(workdir / "metrics.jsonl")}, workdir,
                           per_replica=True)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the run's results are saved; only a figure is lost
        log.warning("drift.png and cosine.png not drawn: %s: %s", type(e).__name__, e)
        return []


def draw_in_background(workdir: pathlib.Path) -> threading.Thread:
    """:func:`run_diagnostics` in a thread, started: a run's last outputs (its final
    checkpoint, its exported params) are written meanwhile; ``join()`` it before the run
    returns."""
    thread = threading.Thread(target=run_diagnostics, args=(workdir,), name="figures")
    thread.start()
    return thread
