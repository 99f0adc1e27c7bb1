"""A run's sync diagnostics drawn from its ``metrics.jsonl`` (drift and cosine against inner
steps), with nothing but numpy and matplotlib.

The module also runs as a script: a helper process that imports matplotlib while a run builds
and compiles, on a core that is idle then, and draws the run's figures when it ends, while the
run writes its final checkpoint and parameters (:func:`diloco_jax.watch.figures.draw_in_background`
starts it and falls back to drawing in a thread). So it imports nothing of ``diloco_jax``: the
helper must not start JAX."""

from __future__ import annotations

import json
import pathlib
import signal
import sys

import numpy as np

MIN_PT = 9  # no text smaller: the figures are drawn at the width they are shown (7-8 in)
DIAGNOSTICS = (("drift", "drift.png", "drift |anchor - params| at the sync"),
               ("cosine_to_mean", "cosine.png", "cosine to the mean pseudo-gradient"))  # fmt: skip
BOUNDED = ("cosine_to_mean",)  # in [-1, 1]: a linear axis, whatever its values span


def log_scale(values) -> bool:
    """Whether ``values`` (numbers; NaN and None skipped) go on a log axis: all positive and
    spanning more than a decade. On a linear axis a loss from step 0 on is its first points'
    scale, and the end of training, the part a reader compares, a flat line."""
    flat = np.array([np.nan if v is None else v for v in values], float)
    finite = flat[np.isfinite(flat)]
    return bool(finite.size) and bool(finite.min() > 0 and finite.max() > 10 * finite.min())


def sync_events(metrics_path: pathlib.Path) -> list[dict]:
    """The ``sync`` events of a run's ``metrics.jsonl`` (none for the baselines)."""
    if not metrics_path.exists():
        return []
    events = (json.loads(line) for line in metrics_path.read_text().splitlines() if line)
    return [e for e in events if e["event"] == "sync"]


def sync_series(events: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps_S, values_SxR)`` of the diagnostic ``key`` over a run's :func:`sync_events`: the
    inner step of each sync (so runs of different ``sync_every`` share an axis) and float
    per-replica values, NaN where undefined. A replica whose drift is 0 moved nothing in the
    round (the first sync of a warm-up from a learning rate of 0, for one): its cosine is
    undefined (the step writes 0 for it), so NaN, a gap, never a cosine of 0."""
    steps_S = np.array([e["step"] for e in events], float)
    values_SxR = _rows(e[key] for e in events)
    if key == "cosine_to_mean":
        values_SxR = np.where(_rows(e["drift"] for e in events) == 0, np.nan, values_SxR)
    return steps_S, values_SxR


def diagnostics(runs: dict[str, list[dict]], directory: pathlib.Path, *,
                per_replica: bool) -> list[str]:  # fmt: skip
    """``drift.png`` and ``cosine.png`` in ``directory``: the sync diagnostics against inner
    steps (:func:`sync_series`; undefined values are gaps). ``runs[name]``: a run's
    :func:`sync_events`; ``per_replica``: one run, a line per replica; else a line per run, the
    mean over its replicas (NaN, a left-out replica's cosine, skipped). The drift goes on a log
    axis where its non-zero values span more than a decade (:func:`log_scale`), its zeros left
    out (a log axis has no 0); a cosine's axis is linear. Returns the files written (none if no
    run synced)."""
    runs = {name: events for name, events in runs.items() if events}
    if not runs:
        return []
    from matplotlib.figure import Figure  # no pyplot: safe in a thread

    for key, file, ylabel in DIAGNOSTICS:
        fig = Figure(figsize=(7, 4.5))
        ax = fig.add_subplot()
        lines: list[tuple[np.ndarray, np.ndarray, str]] = []
        for name, events in runs.items():
            steps_S, values_SxR = sync_series(events, key)
            if per_replica:
                lines += [(steps_S, values_SxR[:, r], f"replica {r}")
                          for r in range(values_SxR.shape[1])]  # fmt: skip
            else:
                lines.append((steps_S, _nanmean_rows(values_SxR), name))
        drawn = np.concatenate([y for _, y, _ in lines])
        log = key not in BOUNDED and log_scale(drawn[drawn != 0])
        for steps_S, y, label in lines:
            ax.plot(steps_S, np.where(y == 0, np.nan, y) if log else y, marker=".", label=label)
        if log:
            ax.set_yscale("log")
            ylabel += " (log scale; 0 left out)" if (drawn == 0).any() else " (log scale)"
        ax.set_xlabel("inner step", fontsize=MIN_PT + 1)
        ax.set_ylabel(ylabel, fontsize=MIN_PT + 1)
        ax.tick_params(labelsize=MIN_PT)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=MIN_PT)
        fig.tight_layout()
        fig.savefig(directory / file, dpi=120)
    return [file for _, file, _ in DIAGNOSTICS]


def run_figures(workdir: pathlib.Path) -> list[str]:
    """A finished run's ``drift.png`` and ``cosine.png`` in ``workdir`` (a line per replica);
    the files written, none if the run never synced. Raises what drawing raised."""
    return diagnostics({"run": sync_events(workdir / "metrics.jsonl")}, workdir, per_replica=True)


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


def serve(requests, replies) -> None:
    """The helper's loop: matplotlib imported first, then one JSON line per request,
    ``{"workdir": path}``, answered with one line, ``{"files": [...]}`` or ``{"error": "Type:
    message"}``, until ``requests`` ends (the run closed it, or its process is gone)."""
    try:
        from matplotlib.figure import Figure  # noqa: F401 - imported now, while the run starts
    except Exception:  # noqa: BLE001, S110 - each request then answers with the import's error
        pass
    for line in requests:
        try:
            reply: dict[str, object] = {
                "files": run_figures(pathlib.Path(json.loads(line)["workdir"]))
            }
        except Exception as e:  # noqa: BLE001 - the run logs it; its results are saved
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    # The run's signals are the run's: a Ctrl-C to the terminal or a scheduler's SIGTERM to the
    # process group must not end the helper before the run has asked for its figures. The run
    # ends it by closing its input, and so does the run's exit, however it exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the replies own standard output: anything else printed goes to standard error
    replies, sys.stdout = sys.stdout, sys.stderr
    serve(sys.stdin, replies)
