"""The robust merging study's table and figure (``scripts/robust_study.sh``): each merge rule's
final loss against each attack, as a gap to the mean's without an attack.

    uv run python scripts/robust_figure.py RUNS_DIR [--out docs/robust_study.png]

Reads ``RUNS_DIR/<rule>/clean/summary.csv`` (one row: the rule without an attack) and
``RUNS_DIR/<rule>/f<f>/summary.csv`` (a row per attack, ``f`` hostile replicas), each a
``python -m sim`` sweep over seeds. Writes the figure (a heat map per ``f``: a rule per row, an
attack per column, each cell the final loss's gap to the clean mean, in nats) and
``RUNS_DIR/robust_table.md``, and prints the table. A diverged run's loss (not finite) shows
as ``diverged``.
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib

import numpy as np

from diloco_jax.watch.figures import pyplot
from sim.plots import DPI, FONTS, WIDTH

RULES = {  # folder -> how the table names it
    "mean": "mean",
    "clipped_mean": "mean, norms clipped at 1.5 x median",
    "trimmed_mean": "trimmed mean (2 per side)",
    "median": "median",
    "centered_clip": "centered clipping",
}
SHORT = {"mean": "mean", "clipped_mean": "mean, clipped", "trimmed_mean": "trimmed mean",
         "median": "median", "centered_clip": "centered clip"}  # fmt: skip
ATTACKS = ("sign_flip", "scale", "gaussian", "alie", "ipm", "inflate")
CAP = 1.0  # the colour scale's end, in nats over the clean mean


def read(runs: pathlib.Path) -> dict:
    """``{(rule, f, attack): (loss, std, seeds)}``; the clean runs as ``(rule, 0, "none")``."""
    out = {}
    for rule in RULES:
        for folder in sorted((runs / rule).glob("*")):
            path = folder / "summary.csv"
            if not path.exists():
                continue
            f = 0 if folder.name == "clean" else int(folder.name[1:])
            with path.open() as fh:
                for row in csv.DictReader(fh):
                    attack = row["run"].split("attack=")[-1] if f else "none"
                    out[(rule, f, attack)] = (float(row["final_eval_loss"]),
                                              float(row["final_eval_loss_std"] or 0),
                                              int(row["seeds"]))  # fmt: skip
    return out


def _cell(value) -> str:
    if value is None:
        return "-"
    loss, std, _ = value
    return f"{loss:.3f} ± {std:.3f}" if math.isfinite(loss) else "diverged"


def table(results: dict) -> str:
    clean = results.get(("mean", 0, "none"), (math.nan, 0, 0))[0]
    rules = [r for r in RULES if any(k[0] == r for k in results)]
    seeds = max((v[2] for v in results.values()), default=0)
    lines = [f"Final eval loss (nats/token, mean ± std over {seeds} seeds); the clean mean: "
             f"{clean:.3f}.", "",
             "| attack | f | " + " | ".join(RULES[r] for r in rules) + " |",
             "|---|---|" + "---|" * len(rules)]  # fmt: skip
    lines.append("| none | 0 | " + " | ".join(_cell(results.get((r, 0, "none"))) for r in rules)
                 + " |")  # fmt: skip
    for f in sorted({k[1] for k in results if k[1]}):
        for attack in ATTACKS:
            cells = [_cell(results.get((r, f, attack))) for r in rules]
            lines.append(f"| {attack} | {f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(results: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    clean = results[("mean", 0, "none")][0]
    rules = [r for r in RULES if any(k[0] == r for k in results)]
    fs = sorted({k[1] for k in results if k[1]})
    columns = ["none", *ATTACKS]
    plt.rcParams.update(FONTS)
    fig, axes = plt.subplots(1, len(fs), figsize=(WIDTH, 0.55 * len(rules) + 1.6), squeeze=False,
                             constrained_layout=True)  # fmt: skip
    image = None
    for ax, f in zip(axes[0], fs, strict=True):
        gap = np.full((len(rules), len(columns)), np.nan)
        for i, r in enumerate(rules):
            for j, a in enumerate(columns):
                v = results.get((r, 0 if a == "none" else f, a))
                if v is not None:
                    gap[i, j] = v[0] - clean if math.isfinite(v[0]) else np.inf
        shown = np.clip(np.nan_to_num(gap, nan=np.nan, posinf=CAP), -CAP, CAP)
        image = ax.imshow(shown, cmap="RdYlGn_r", vmin=-0.1, vmax=CAP, aspect="auto")
        for i in range(len(rules)):
            for j in range(len(columns)):
                g = gap[i, j]
                text = "-" if np.isnan(g) else ("div." if np.isinf(g) else (
                    f"{g:+.2f}" if abs(g) < 10 else f"{g:+.0f}"))  # fmt: skip
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(columns)), columns, rotation=35, ha="right")
        ax.set_yticks(range(len(rules)), [SHORT[r] for r in rules])
        ax.set_title(f"f = {f} of 8 replicas hostile")
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), label="final loss - clean mean (nats)")
    fig.suptitle("Merge rules against attacks: the gap to the mean without one")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/robust_study.png"))
    args = parser.parse_args()
    results = read(args.runs)
    if ("mean", 0, "none") not in results:
        raise SystemExit(f"{args.runs}: no mean/clean/summary.csv (run scripts/robust_study.sh)")
    text = table(results)
    (args.runs / "robust_table.md").write_text(text + "\n")
    print(text)
    figure(results, args.out)
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
