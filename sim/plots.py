"""Figures of a sweep: loss curves and the loss-communication trade-off."""

from __future__ import annotations

import pathlib

import matplotlib

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
