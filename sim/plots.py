"""Figures of a sweep: loss curves and the loss-communication trade-off."""

from __future__ import annotations

import pathlib

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402


def curves(runs: dict[str, dict], path: pathlib.Path, *, title: str = "") -> None:
    """Validation loss of the outer parameters against tokens and inner steps, a line per run.

    ``runs[name] = {"tokens": [...], "steps": [...], "loss": [...]}`` (means over seeds).
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, run in runs.items():
        style = "--" if name in ("single", "ddp") else "-"
        axes[0].plot(run["tokens"], run["loss"], style, label=name, marker=".")
        axes[1].plot(run["steps"], run["loss"], style, label=name, marker=".")
    axes[0].set_xlabel("tokens seen (all replicas)")
    axes[1].set_xlabel("inner steps per replica (~ wall-clock)")
    axes[0].set_ylabel("validation loss (nats/token)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title or "validation loss of the outer parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tradeoff(rows: list[dict], path: pathlib.Path, *, title: str = "") -> None:
    """Final validation loss against bytes each replica sent (log scale); runs that sent
    nothing are drawn as horizontal lines. Runs named ``family: label`` get one colour per
    family (a legend) and are annotated with their label."""
    fig, ax = plt.subplots(figsize=(10, 6) if len(rows) > 8 else (7, 4.5))
    colours: dict[str, str] = {}
    for row in rows:
        family, _, label = row["run"].rpartition(": ")
        if family not in colours:
            colours[family] = f"C{len(colours) % 10}"
        colour = colours[family]
        if row["bytes_per_replica"] > 0:
            ax.scatter(row["bytes_per_replica"], row["final_eval_loss"], color=colour,
                       label=family or None)  # fmt: skip
            ax.annotate(label, (row["bytes_per_replica"], row["final_eval_loss"]),
                        fontsize=7, xytext=(4, 2), textcoords="offset points")  # fmt: skip
        else:
            ax.axhline(row["final_eval_loss"], linestyle=":", color="gray")
            ax.annotate(f"{label} (no communication)", (0.02, row["final_eval_loss"]),
                        xycoords=("axes fraction", "data"), fontsize=7)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per replica (log scale)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.grid(alpha=0.3, which="both")
    handles, labels = ax.get_legend_handles_labels()
    if any(labels):
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_title(title or "loss against communication")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _panel(ax, rows: list[dict], x_key: str, colours: dict[str, str]) -> None:
    """Scatter of final loss against ``x_key`` (log), labels stacked where points coincide."""
    stacked: dict[tuple, int] = {}
    for row in rows:
        family = row["run"].rpartition(": ")[0]
        colour = colours.setdefault(family, f"C{len(colours) % 10}")
        x, y = row[x_key], row["final_eval_loss"]
        if x <= 0:
            ax.axhline(y, linestyle=":", color="gray")
            ax.annotate(f"{row['run']} (no communication)", (0.02, y),
                        xycoords=("axes fraction", "data"), fontsize=7)  # fmt: skip
            continue
        ax.scatter(x, y, color=colour, label=family)
        slot = (round(float(np.log10(x)), 1), round(y, 2))
        stacked[slot] = stacked.get(slot, -1) + 1
        name = row["run"].rpartition(": ")[2]
        label = name if name in ("ddp", "single", "diloco") else row.get("codec", name)
        ax.annotate(label, (x, y), fontsize=6.5, color=colour,
                    xytext=(4, 2 - 8 * stacked[slot]), textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")


def tradeoff_two_panels(rows: list[dict], path: pathlib.Path, *, title: str = "") -> None:
    """Left: final loss against total bytes per replica, every run. Right: against the peak
    bytes of one sync, only the runs within 0.2 nats of the best (where codecs and streaming
    differ). Points are labelled with how they communicate; colours are the sweeps."""
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
