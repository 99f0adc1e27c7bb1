"""``python -m sim.combine`` (installed: ``diloco-combine``): one table and one loss-against-bytes
figure from several sweeps.

    python -m sim.combine SWEEP_DIR... --out DIR [--title TEXT]
    python -m sim.combine --replot DIR [--title TEXT]

Reads each sweep's ``summary.csv`` (written by ``python -m sim``), writes ``DIR/table.md`` (a
markdown table sorted by bytes), ``DIR/rows.json`` (the rows and the title, plain JSON) and
``DIR/tradeoff.png`` (final validation loss against total bytes each replica sent; below, for the
runs within 0.2 nats of the best, against the peak bytes of one sync; log scales; a point per
run, with an error bar where it has several seeds; runs that send nothing as horizontal lines). A
run is named ``<sweep dir name>: <run>``.

``--replot DIR`` redraws ``DIR/table.md`` and ``DIR/tradeoff.png`` from ``DIR/rows.json`` alone,
without the sweeps: a change to the figure needs no rerun (``--title`` replaces the saved title).
"""

from __future__ import annotations

import csv
import json
import pathlib
import sys

from diloco_jax.base import extras
from diloco_jax.base.commandline import ArgumentParser, check_output_dir
from diloco_jax.config import ConfigError

from . import plots
from .sweep import wallclock_cell, wallclock_note

NUMBERS = ("final_eval_loss", "final_eval_loss_std", "best_eval_loss", "bytes_per_replica",
           "bytes_vs_ddp", "sim_wallclock_s", "utilization", "seeds", "tokens",
           "peak_sync_bytes")  # fmt: skip
# in summaries since the wall-clock's spread over seeds was: parsed where a summary holds them
SPREAD = ("sim_wallclock_s_min", "sim_wallclock_s_max")
DEFAULT_TITLE = "final loss against bytes sent"


def read(sweep_dirs: list[pathlib.Path]) -> list[dict]:
    """The summary rows of every sweep, numbers parsed, runs named by their sweep."""
    rows = []
    for directory in sweep_dirs:
        path = directory / "summary.csv"
        if not path.is_file():  # a missing directory too
            raise FileNotFoundError(f"{path} not found: run `python -m sim` into {directory} first")
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    for key in NUMBERS:
                        row[key] = float(row[key])
                    for key in (k for k in SPREAD if row.get(k)):
                        row[key] = float(row[key])
                    row["step_time_measured"] = row.get("step_time_measured") == "True"
                    row["run"] = f"{directory.name}: {row['run']}"
                except (KeyError, TypeError, ValueError):
                    raise ConfigError(f"{path} is not a summary.csv of `python -m sim`") from None
                rows.append(row)
    return rows


def read_rows_json(directory: pathlib.Path) -> tuple[list[dict], str]:
    """The rows and title a combine saved in ``directory/rows.json``."""
    path = directory / "rows.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `python -m sim.combine ... --out "
                                f"{directory}` first")  # fmt: skip
    try:
        saved = json.loads(path.read_text())
        rows, title = saved["rows"], saved["title"]
        for row in rows:
            for key in (*NUMBERS, "run", "codec"):
                row[key]  # noqa: B018 - a KeyError names a file that is not ours
            for key in NUMBERS:
                row[key] = float(row[key])
        if not isinstance(title, str) or not rows:
            raise ValueError
    except (KeyError, TypeError, ValueError):  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"{path} is not a rows.json of `python -m sim.combine`") from None
    return rows, title


def table(rows: list[dict]) -> str:
    """Markdown, sorted by bytes sent (then loss); a note under it where a wall-clock came from
    a measured step time (:data:`sim.sweep.WALLCLOCK_NOTE`)."""
    head = ("run", "communication", "final val loss", "bytes sent per replica", "vs ddp",
            "peak bytes per sync", "sim wall-clock (s)", "utilization")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in sorted(rows, key=lambda r: (r["bytes_per_replica"], r["final_eval_loss"])):
        spread = f" ± {r['final_eval_loss_std']:.3f}" if r["seeds"] > 1 else ""
        lines.append(
            f"| {r['run']} | {r['codec']} | {r['final_eval_loss']:.3f}{spread} | "
            f"{r['bytes_per_replica']:.3g} | {r['bytes_vs_ddp']:.3g} | "
            f"{r['peak_sync_bytes']:.3g} | {wallclock_cell(r)} | {r['utilization']:.2f} |"
        )
    return "\n".join(lines) + "\n" + wallclock_note(rows)


def write(rows: list[dict], out: pathlib.Path, title: str) -> None:
    """``table.md``, ``rows.json`` and ``tradeoff.png`` in ``out``."""
    (out / "table.md").write_text(table(rows))
    (out / "rows.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1) + "\n")
    plots.tradeoff_two_panels(rows, out / "tradeoff.png", title=title)


def main(argv: list[str] | None = None, *, prog: str = f"python -m {__package__}.combine") -> int:
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="*", type=pathlib.Path, help="sweep directories")
    parser.add_argument("--out", help="output directory (with sweep directories)")
    parser.add_argument("--replot", type=pathlib.Path, metavar="DIR",
                        help="redraw DIR's table.md and tradeoff.png from DIR/rows.json "
                             "(no sweep directories, no --out)")  # fmt: skip
    parser.add_argument("--title", default=None, help=f"default: {DEFAULT_TITLE!r}")
    args = parser.parse_args(argv)
    try:
        if args.replot is not None and (args.sweeps or args.out is not None):
            raise ConfigError("--replot DIR takes no sweep directories and no --out")
        if args.replot is None and (not args.sweeps or args.out is None):
            raise ConfigError("give sweep directories and --out DIR (or --replot DIR)")
        extras.check("drawing tradeoff.png", "matplotlib")  # the figure is what combine is for
        if args.replot is not None:
            rows, title = read_rows_json(args.replot)
            out = args.replot
        else:
            rows, title = read(args.sweeps), DEFAULT_TITLE
            out = check_output_dir(args.out, "--out")
    except (FileNotFoundError, ConfigError, extras.MissingExtra) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    write(rows, out, title if args.title is None else args.title)
    print(table(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
