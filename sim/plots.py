"""Figures of a sweep: loss curves and the loss-communication trade-off.

matplotlib is optional (the ``plots`` extra): it is imported when a figure is drawn, so the rest
of the simulator works without it.
"""

from __future__ import annotations

import pathlib
from collections import Counter

from diloco_jax.watch.drawing import log_scale
from diloco_jax.watch.figures import pyplot

# The figures are drawn for a ~750 px documentation column: WIDTH inches at DPI (1.6x
# the column), so a LABEL_PT font shows at about 12 px.
WIDTH, DPI, LABEL_PT = 8.0, 150, 9.5
FONTS = {"font.size": 10, "axes.labelsize": 11, "axes.titlesize": 11, "xtick.labelsize": 10,
         "ytick.labelsize": 10, "figure.titlesize": 12}  # fmt: skip
# 16 colours and 11 markers: a family's (colour, marker) pair is its own for up to 176 families
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#000080", "#bcbd22", "#7f7f7f", "#008080", "#800000", "#4b0082",
           "#808000", "#ff1493")  # fmt: skip
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")
# shorter run names within a sweep: "outer-adam: lr=0.01", "codecs: int4"
SHORT_KEYS = {"learning_rate=": "lr=", "codec=": ""}
BASELINES = ("single", "ddp")


def loss_label(unit: str, nats: bool) -> str:
    """``validation loss (nats/token)``, ``(nats/example)``, or without units (a user's loss)."""
    return f"validation loss (nats/{unit})" if nats else "validation loss"


def metric_label(metric: str, unit: str, nats: bool, label: str = "") -> str:
    """``label`` (``sim.plot_label``: what the user calls it) if given; else :func:`loss_label`
    for ``eval_loss``, the metric's own name otherwise."""
    return label or (loss_label(unit, nats) if metric == "eval_loss" else metric)


def curves(runs: dict[str, dict], path: pathlib.Path, *, title: str = "", unit: str = "token",
           nats: bool = True, metric: str = "eval_loss", label: str = "") -> None:  # fmt: skip
    """The evaluation's ``metric`` (validation loss by default) of the outer parameters against
    tokens (or examples: ``unit``) and inner steps, a line per run. ``runs[name] = {"tokens":
    [...], "steps": [...], "loss": [...]}`` (means over seeds), with ``low`` / ``high`` (the
    seeds' min and max) drawn as a band where ``seeds`` > 1; ``nats``: the loss is in nats
    (the built-in tasks'); ``label``: the axis's name (:func:`metric_label`). A log axis where
    the values span more than a decade (:func:`~diloco_jax.watch.drawing.log_scale`)."""
    plt = pyplot()
    drawn = [v for r in runs.values() for k in ("loss", "low", "high") for v in r.get(k, ())]
    log = log_scale(drawn)
    ylabel = metric_label(metric, unit, nats, label) + (" (log scale)" if log else "")
    with plt.rc_context(FONTS):
        fig, axes = plt.subplots(2, 1, figsize=(WIDTH, 8.5), dpi=DPI, sharey=True)
        for i, (name, run) in enumerate(runs.items()):
            style = "--" if name in BASELINES else "-"
            colour = PALETTE[i % len(PALETTE)]
            for ax, x in zip(axes, (run["tokens"], run["steps"]), strict=True):
                ax.plot(x, run["loss"], style, label=name, marker=".", color=colour)
                if run.get("seeds", 1) > 1:
                    ax.fill_between(x, run["low"], run["high"], color=colour, alpha=0.2,
                                    linewidth=0)  # fmt: skip
        axes[0].set_xlabel(f"{unit}s seen (all replicas)")
        axes[1].set_xlabel("inner steps per replica (~ wall-clock)")
        for ax in axes:
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        if log:
            axes[0].set_yscale("log")  # both: they share the axis
            for ax in axes:
                ax.grid(alpha=0.12, which="minor")
        handles, names = axes[0].get_legend_handles_labels()
        rows = -(-len(names) // 3)  # the legend above the panels, 3 runs a row: it hides no line
        fig.legend(handles, names, loc="upper center", ncol=3, fontsize=LABEL_PT, frameon=False,
                   bbox_to_anchor=(0.5, 0.965))  # fmt: skip
        band = (
            " (band: min-max over seeds)"
            if any(r.get("seeds", 1) > 1 for r in runs.values())
            else ""
        )
        what = label or ("validation loss" if metric == "eval_loss" else metric)
        fig.suptitle(title or f"{what} of the outer parameters{band}")
        fig.tight_layout(rect=(0, 0, 1, 0.965 - 0.022 * rows))
        fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _family(row: dict) -> str:
    """A combined run's sweep (``family: run``); "" for a sweep's own runs."""
    return row["run"].rpartition(": ")[0]


def point_labels(rows: list[dict]) -> dict[str, str]:
    """``{run: label}`` naming each run's method: a baseline by its name (single, ddp), a sweep's
    only run by the sweep (``muloco``), and a run that shares its sweep as ``sweep: run``
    (``outer-adam: lr=0.01``)."""
    per_family = Counter(_family(r) for r in rows if r["run"].rpartition(": ")[2] not in BASELINES)
    labels = {}
    for row in rows:
        family, name = _family(row), row["run"].rpartition(": ")[2]
        if not family or name in BASELINES:
            labels[row["run"]] = name
        elif per_family[family] == 1 or name == "diloco":
            labels[row["run"]] = family
        else:
            for long, short in SHORT_KEYS.items():
                name = name.replace(long, short)
            labels[row["run"]] = f"{family}: {name}"
    return labels


def _styles(rows: list[dict]) -> dict[str, tuple[str, str]]:
    """``{run: (colour, marker)}``, one pair per family (runs without one each get their own)."""
    families: dict[str, tuple[str, str]] = {}
    for row in rows:
        key = _family(row) or row["run"]
        if key not in families:
            i = len(families)
            families[key] = (PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)])
    return {r["run"]: families[_family(r) or r["run"]] for r in rows}


def _darker(colour: str) -> tuple[float, ...]:
    """The colour a label is written in: the point's, darkened (light colours read badly)."""
    from matplotlib.colors import to_rgb

    return tuple(0.7 * c for c in to_rgb(colour))


def _panel(ax, rows: list[dict], x_key: str, styles: dict, labels: dict, *,
           y_key: str = "final_eval_loss") -> tuple[list, list]:  # fmt: skip
    """Scatter of ``y_key`` against ``x_key`` (log), a marker and colour per family, an error bar
    of one standard deviation where a run has several seeds; runs at x = 0 (nothing sent) as
    horizontal lines. The y axis is log where the values span more than a decade
    (:func:`~diloco_jax.watch.drawing.log_scale`; the caller's label says so). Returns the
    labels to place: ``(text, x, y, colour)`` per point and ``(text, y)`` per line."""
    points, lines = [], []
    for row in rows:
        x, y = row[x_key], row[y_key]
        if x <= 0:
            ax.axhline(y, linestyle=":", color="gray", linewidth=1.2)
            lines.append((f"{labels[row['run']]} (no communication)", y))
            continue
        colour, marker = styles[row["run"]]
        std = row.get(f"{y_key}_std", 0.0) if row.get("seeds", 1) > 1 else 0.0
        ax.errorbar(x, y, yerr=std or None, fmt=marker, color=colour, markersize=8,
                    capsize=3, elinewidth=1.2, markeredgecolor="white",
                    markeredgewidth=0.5)  # fmt: skip
        points.append((labels[row["run"]], x, y, colour))
    ax.set_xscale("log")
    if log_scale([row[y_key] for row in rows]):
        ax.set_yscale("log")
    ax.margins(x=0.08, y=0.1)
    ax.grid(alpha=0.3, which="both")
    return points, lines


def _overlaps(box, boxes) -> bool:
    return any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes)


class _Canvas:
    """Pixel geometry of one axes in the final layout, for placing labels: its frame, the data
    to pixels, a text's size at LABEL_PT, and the boxes already taken."""

    def __init__(self, fig, ax):
        self.ax, self.renderer = ax, fig.canvas.get_renderer()
        self.frame = ax.get_window_extent(self.renderer)
        self.to_px = ax.transData.transform
        self.pt = fig.dpi / 72  # pixels per point
        self.taken: list[tuple] = []

    def size(self, text: str) -> tuple[float, float]:
        probe = self.ax.text(0, 0, text, fontsize=LABEL_PT, transform=None)
        box = probe.get_window_extent(self.renderer)
        probe.remove()
        return box.width, box.height

    def inside(self, box) -> bool:
        f = self.frame
        return (
            box[0] >= f.x0 + 2 and box[2] <= f.x1 - 2 and box[1] >= f.y0 + 2 and box[3] <= f.y1 - 2
        )


def _place_labels(fig, ax, points: list, lines: list) -> None:
    """Writes the labels next to their points without overlaps: each label takes the nearest free
    slot to the right or left of its point, nudged up or down in steps of its height (a thin
    leader line where it moved), inside the axes; the lines' labels sit at the right edge, above
    their line (below where that is taken). Works in pixels of the final layout."""
    canvas = _Canvas(fig, ax)
    radius = 5 * canvas.pt
    markers = []
    for _, x, y, _ in points:
        px, py = canvas.to_px((x, y))
        markers.append((px - radius, py - radius, px + radius, py + radius))
    for text, y in lines:
        _place_line_label(canvas, text, y, markers)
    order = sorted(range(len(points)), key=lambda i: canvas.to_px(points[i][1:3])[1])
    for i in order:
        _place_point_label(canvas, points[i], radius, markers[:i] + markers[i + 1 :])


def _place_line_label(canvas: _Canvas, text: str, y: float, markers: list) -> None:
    """A horizontal line's label at the right edge, above the line (below where that is taken)."""
    w, h = canvas.size(text)
    _, py = canvas.to_px((1.0, y))
    frame, pt = canvas.frame, canvas.pt
    for y0 in (py + 2, py - 2 - h):  # above the line, else below
        box = (frame.x1 - 4 - w, y0, frame.x1 - 4, y0 + h)
        if canvas.inside(box) and not _overlaps(box, markers + canvas.taken):
            break
    canvas.taken.append(box)
    canvas.ax.annotate(text, (1.0, y), xycoords=("axes fraction", "data"), xytext=(-4 / pt,
                       (box[1] - py) / pt), textcoords="offset points", fontsize=LABEL_PT,
                       color="dimgray", ha="right", va="bottom")  # fmt: skip


def _place_point_label(canvas: _Canvas, point: tuple, radius: float, others: list) -> None:
    """A point's label in the nearest free slot, right side first, with a leader line where it
    moved up or down; over whatever is there if no slot is free."""
    text, x, y, colour = point
    w, h = canvas.size(text)
    px, py = canvas.to_px((x, y))
    gap, step = radius + 2 * canvas.pt, h + 1
    candidates = sorted(  # (cost, side, dy): near first, the right side first
        (abs(k) * step + (0.6 * step if side < 0 else 0), side, k * step)
        for side in (1, -1)
        for k in range(-12, 13)
    )
    chosen = None
    for _, side, dy in candidates:
        x0 = px + gap if side > 0 else px - gap - w
        box = (x0, py + dy - h / 2, x0 + w, py + dy + h / 2)
        if canvas.inside(box) and not _overlaps(box, canvas.taken + others):
            chosen = side, dy, box
            break
    if chosen is None:  # nowhere free: to the right, over whatever is there
        chosen = 1, 0.0, (px + gap, py - h / 2, px + gap + w, py + h / 2)
    side, dy, box = chosen
    canvas.taken.append(box)
    pt = canvas.pt
    leader = {"arrowstyle": "-", "color": colour, "linewidth": 0.7, "shrinkA": 0,
              "shrinkB": radius / pt}  # fmt: skip
    canvas.ax.annotate(text, (x, y), xytext=(side * gap / pt, dy / pt),
                       textcoords="offset points", fontsize=LABEL_PT, color=_darker(colour),
                       va="center", ha="left" if side > 0 else "right",
                       arrowprops=leader if abs(dy) > h / 2 else None)  # fmt: skip


def _log_note(ax) -> str:
    return " (log scale)" if ax.get_yscale() == "log" else ""


def _error_bar_note(rows: list[dict]) -> str:
    return "; bars: ± 1 std over seeds" if any(r.get("seeds", 1) > 1 for r in rows) else ""


def tradeoff(rows: list[dict], path: pathlib.Path, *, title: str = "", unit: str = "token",
             nats: bool = True, metric: str = "eval_loss", label: str = "") -> None:  # fmt: skip
    """The final ``metric`` (validation loss by default; ``label``: its name, as for
    :func:`curves`) against bytes each replica sent (log scale), a labelled point per run (a
    bar of ± one standard deviation where it has several seeds); runs that sent nothing are
    drawn as horizontal lines labelled at the right edge. The loss axis is log where the
    losses span more than a decade."""
    plt = pyplot()
    with plt.rc_context(FONTS):
        fig, ax = plt.subplots(figsize=(WIDTH, 5.2), dpi=DPI)
        points, lines = _panel(ax, rows, "bytes_per_replica", _styles(rows), point_labels(rows),
                               y_key=f"final_{metric}")  # fmt: skip
        ax.set_xlabel("bytes sent per replica (log scale)")
        ax.set_ylabel(f"final {metric_label(metric, unit, nats, label)}" + _log_note(ax))
        ax.set_title((title or "loss against communication") + _error_bar_note(rows))
        fig.tight_layout()
        _place_labels(fig, ax, points, lines)
        fig.savefig(path, dpi=DPI)
    plt.close(fig)


def tradeoff_two_panels(rows: list[dict], path: pathlib.Path, *, title: str = "") -> None:
    """Top: final loss against total bytes per replica, every run. Bottom: another quantity,
    the peak bytes of one sync (where streaming differs), for the runs within 0.2 nats of the
    best. A point per run, labelled with its method (its sweep, and its run where the sweep
    has several), a colour and marker per sweep, a bar of ± one standard deviation where it has
    several seeds; each panel's title names its x axis; a panel's loss axis is log where its
    losses span more than a decade."""
    plt = pyplot()
    styles, labels = _styles(rows), point_labels(rows)
    best = min(r["final_eval_loss"] for r in rows)
    close = [r for r in rows if r["final_eval_loss"] <= best + 0.2]
    with plt.rc_context(FONTS):
        fig, (top, bottom) = plt.subplots(
            2, 1, figsize=(WIDTH, 10.5), dpi=DPI, height_ratios=(1.1, 1)
        )
        placed = [_panel(top, rows, "bytes_per_replica", styles, labels),
                  _panel(bottom, close, "peak_sync_bytes", styles, labels)]  # fmt: skip
        top.set_xlabel("bytes sent per replica over the run (log scale)")
        bottom.set_xlabel("peak bytes of one sync per replica (log scale)")
        for ax in (top, bottom):
            ax.set_ylabel("final validation loss (nats/token)" + _log_note(ax))
        top.set_title("every run, against the bytes sent over the run" + _error_bar_note(rows))
        bottom.set_title(f"the runs within 0.2 nats of the best ({best:.3f}), against the "
                         "peak bytes of one sync")  # fmt: skip
        fig.suptitle(title or "loss against communication")
        fig.tight_layout()
        for ax, (points, lines) in zip((top, bottom), placed, strict=True):
            _place_labels(fig, ax, points, lines)
        fig.savefig(path, dpi=DPI)
    plt.close(fig)
