"""The overlap study's figure and table (``scripts/overlap_study.sh``): final loss against the
share of the link's time each mode hides, one panel per ``sync_every``.

    uv run python scripts/overlap_figure.py RUNS_DIR [--out docs/overlap_study.png]

Reads ``RUNS_DIR/H<sync_every>/<arm>/summary.csv`` (each a ``python -m sim`` sweep over seeds).
The share hidden is ``1 - stall / stall of the synchronous arm``, where a run's stall is the
part of its simulated wall-clock its replicas do not compute (``1 - utilization``): of the
link's time that synchronous rounds wait out, the share the mode does not. Writes the figure
and ``RUNS_DIR/overlap_table.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import pathlib

from diloco_jax.watch.figures import pyplot
from sim.plots import DPI, FONTS, WIDTH

BASE = "sync"  # the arm every other is set against: synchronous rounds, the paper's momentum
ABOUT = {  # arm -> what it is, for the table
    "sync": "synchronous, outer momentum 0.9 (the paper)",
    "sync-0.5": "synchronous, outer momentum 0.5",
    "sync-0": "synchronous, outer momentum 0",
    "delayed-0.9": "delayed, momentum 0.9",
    "delayed": "delayed, its own momentum (0)",
    "delayed-0.3": "delayed, momentum 0.3",
    "eager-0.9": "eager, momentum 0.9",
    "eager": "eager, its own momentum (0.5)",
    "stream-tau1": "streaming F=1, tau 1, alpha 0.5",
    "stream-tau5": "streaming F=1, tau 5, alpha 0.5",
    "stream-tau5-alpha0": "streaming F=1, tau 5, alpha 0",
    "stream-F2-tau4": "streaming F=2, tau 4, alpha 0.5",
    "sync-mix0.5": "synchronous, landing mixed (alpha 0.5)",
}


def rows_of(runs: pathlib.Path) -> dict[int, list[dict]]:
    """``{sync_every: [row, ...]}``: each arm's mean and spread over seeds, its share hidden
    and its loss against :data:`BASE`'s."""
    out: dict[int, list[dict]] = {}
    for folder in sorted(runs.glob("H*"), key=lambda p: int(p.name[1:])):
        rows = []
        for summary in sorted(folder.glob("*/summary.csv")):
            with summary.open() as f:
                row = next(csv.DictReader(f))
            rows.append({"arm": summary.parent.name, "seeds": int(row["seeds"]),
                         "loss": float(row["final_eval_loss"]),
                         "std": float(row["final_eval_loss_std"] or 0),
                         "wall": float(row["sim_wallclock_s"]),
                         "stall": float(row["sim_wallclock_s"]) * (1 - float(row["utilization"])),
                         "tokens": int(float(row["tokens"]))})  # fmt: skip
        base = next((r for r in rows if r["arm"] == BASE), None)
        if base is None:
            continue
        for r in rows:
            r["hidden"] = 1 - r["stall"] / base["stall"] if base["stall"] > 0 else 0.0
            r["vs_sync"] = r["loss"] - base["loss"]
        out[int(folder.name[1:])] = sorted(rows, key=lambda r: (-r["hidden"], r["loss"]))
    return out


def table(by_h: dict[int, list[dict]]) -> str:
    lines = ["| sync_every | arm | what | seeds | link time hidden | final loss | vs sync |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for h, rows in by_h.items():
        for r in rows:
            lines.append(f"| {h} | {r['arm']} | {ABOUT.get(r['arm'], r['arm'])} | {r['seeds']} "
                         f"| {r['hidden']:.0%} | {r['loss']:.3f} ± {r['std']:.3f} | "
                         f"{r['vs_sync']:+.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def figure(by_h: dict[int, list[dict]], path: pathlib.Path) -> None:
    plt = pyplot()
    with plt.rc_context(FONTS):
        fig, axes = plt.subplots(len(by_h), 1, figsize=(WIDTH, 4.6 * len(by_h)), dpi=DPI,
                                 squeeze=False)  # fmt: skip
        for ax, (h, rows) in zip(axes[:, 0], by_h.items(), strict=True):
            base = next(r for r in rows if r["arm"] == BASE)
            top = base["loss"] + 0.4
            ax.axhspan(base["loss"] - 0.05, base["loss"] + 0.05, color="0.9", zorder=0)
            ax.axhline(base["loss"], color="0.5", lw=1, ls="--", zorder=1)
            for r in rows:
                colour = ("tab:blue" if r["arm"].startswith("sync") else "tab:orange"
                          if r["arm"].startswith("eager") else "tab:red"
                          if r["arm"].startswith("delayed") else "tab:green")  # fmt: skip
                y, label = r["loss"], r["arm"]
                if y > top:  # off the panel: at its top edge, its value said
                    y, label = top, f"{r['arm']}: {r['loss']:.2f}, above the panel"
                ax.errorbar(100 * r["hidden"], y, yerr=r["std"] if y == r["loss"] else None,
                            fmt="^" if y != r["loss"] else "o", color=colour, capsize=3,
                            ms=7)  # fmt: skip
                off = y != r["loss"]  # its label left of it, inside the panel
                ax.annotate(label, (100 * r["hidden"], y), xytext=(-8, -4) if off else (6, 4),
                            ha="right" if off else "left", textcoords="offset points",
                            fontsize=9)  # fmt: skip
            ax.set_ylim(top=top + 0.05)
            ax.set_xlim(-5, 125)
            ax.set_xlabel("link time hidden (% of what synchronous rounds wait)")
            ax.set_ylabel("final validation loss (nats/token)")
            ax.set_title(f"sync_every {h}: 50 rounds, {rows[0]['tokens']:,} tokens; grey band: "
                         "sync ± 0.05")  # fmt: skip
        fig.suptitle("overlap against loss: 2 replicas, 3 seeds (mean ± std)")
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=pathlib.Path)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/overlap_study.png"))
    args = p.parse_args()
    by_h = rows_of(args.runs)
    if not by_h:
        p.error(f"no H*/sync/summary.csv under {args.runs}")
    text = table(by_h)
    (args.runs / "overlap_table.md").write_text(text)
    print(text)
    figure(by_h, args.out)
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
