"""Figures of a sweep: loss curves and the loss-communication trade-off.

matplotlib is optional (the ``plots`` extra): it is imported when a figure is drawn, so the rest
of the simulator works without it.
"""

from __future__ import annotations

import pathlib

import numpy as np

from diloco_jax.watch.figures import pyplot


def loss_label(unit: str, nats: bool) -> str:
    """``validation loss (nats/token)``, ``(nats/example)``, or without units (a user's loss)."""
    return f"validation loss (nats/{unit})" if nats else "validation loss"


def metric_label(metric: str, unit: str, nats: bool) -> str:
    """:func:`loss_label` for ``eval_loss``, else the metric's own name."""
    return loss_label(unit, nats) if metric == "eval_loss" else metric


def curves(runs: dict[str, dict], path: pathlib.Path, *, title: str = "", unit: str = "token",
           nats: bool = True, metric: str = "eval_loss") -> None:  # fmt: skip
    """The evaluation's ``metric`` (validation loss by default) of the outer parameters against
    tokens (or examples: ``unit``) and inner steps, a line per run. ``runs[name] = {"tokens":
    [...], "steps": [...], "loss": [...]}`` (means over seeds), with ``low`` / ``high`` (the
    seeds' min and max) drawn as a band where ``seeds`` > 1; ``nats``: the loss is in nats
    (the built-in tasks')."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, (name, run) in enumerate(runs.items()):
        style, colour = ("--" if name in ("single", "ddp") else "-"), f"C{i % 10}"
        for ax, x in zip(axes, (run["tokens"], run["steps"]), strict=True):
            ax.plot(x, run["loss"], style, label=name, marker=".", color=colour)
            if run.get("seeds", 1) > 1:
                ax.fill_between(x, run["low"], run["high"], color=colour, alpha=0.2,
                                linewidth=0)  # fmt: skip
    axes[0].set_xlabel(f"{unit}s seen (all replicas)")
    axes[1].set_xlabel("inner steps per replica (~ wall-clock)")
    axes[0].set_ylabel(metric_label(metric, unit, nats))
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    band = (
        " (band: min-max over seeds)" if any(r.get("seeds", 1) > 1 for r in runs.values()) else ""
    )
    what = "validation loss" if metric == "eval_loss" else metric
    fig.suptitle(title or f"{what} of the outer parameters{band}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tradeoff(rows: list[dict], path: pathlib.Path, *, title: str = "", unit: str = "token",
             nats: bool = True, metric: str = "eval_loss") -> None:  # fmt: skip
    """The final ``metric`` (validation loss by default) against bytes each replica sent (log
    scale), a point per run named by its run; runs that sent nothing are drawn as horizontal
    lines."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _panel(ax, rows, "bytes_per_replica", {}, label_of=lambda row: row["run"],
           y_key=f"final_{metric}")  # fmt: skip
    ax.set_xlabel("bytes sent per replica (log scale)")
    ax.set_ylabel(f"final {metric_label(metric, unit, nats)}")
    ax.set_title(title or "loss against communication")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _communication_label(row: dict) -> str:
    name = row["run"].rpartition(": ")[2]
    return name if name in ("ddp", "single", "diloco") else row.get("codec", name)


def _panel(ax, rows: list[dict], x_key: str, colours: dict[str, str], *,
           label_of=_communication_label, y_key: str = "final_eval_loss") -> None:  # fmt: skip
    """Scatter of ``y_key`` (the final loss) against ``x_key`` (log), one colour per family
    (runs named ``family: label``), labels stacked where points coincide."""
    stacked: dict[tuple, int] = {}
    for row in rows:
        family = row["run"].rpartition(": ")[0]
        # a colour per family; runs without one each get their own
        colour = colours.setdefault(family or row["run"], f"C{len(colours) % 10}")
        x, y = row[x_key], row[y_key]
        if x <= 0:
            ax.axhline(y, linestyle=":", color="gray")
            ax.annotate(f"{row['run']} (no communication)", (0.02, y),
                        xycoords=("axes fraction", "data"), fontsize=7)  # fmt: skip
            continue
        ax.scatter(x, y, color=colour, label=family)
        slot = (round(float(np.log10(x)), 1), round(y, 2))
        stacked[slot] = stacked.get(slot, -1) + 1
        ax.annotate(label_of(row), (x, y), fontsize=6.5, color=colour,
                    xytext=(4, 2 - 8 * stacked[slot]), textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")


def tradeoff_two_panels(rows: list[dict], path: pathlib.Path, *, title: str = "") -> None:
    """Left: final loss against total bytes per replica, every run. Right: against the peak
    bytes of one sync, only the runs within 0.2 nats of the best (where codecs and streaming
    differ). Points are labelled with how they communicate; colours are the sweeps."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6.5))
    colours: dict[str, str] = {}
    _panel(left, rows, "bytes_per_replica", colours)
    best = min(r["final_eval_loss"] for r in rows)
    close = [r for r in rows if r["final_eval_loss"] <= best + 0.2]
    _panel(right, close, "peak_sync_bytes", colours)
    left.set_xlabel("bytes sent per replica over the run (log scale)")
    right.set_xlabel("peak bytes of one sync per replica (log scale)")
    left.set_ylabel("final validation loss (nats/token)")
    right.set_title(f"zoom: runs within 0.2 nats of the best ({best:.3f})", fontsize=10)
    handles, labels = left.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    left.legend(unique.values(), unique.keys(), fontsize=8, loc="upper right")
    fig.suptitle(title or "loss against communication")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
