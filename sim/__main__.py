"""``python -m sim``: a sweep of DiLoCo variants as virtual workers on one device.

    python -m sim --config PRESET --workdir DIR [--sweep KEY=V1,V2,...]... \\
        [--baselines single,ddp] [--seeds 0,1,2] [--config.KEY=VALUE ...]

Any config key can be swept (but ``seed``: use ``--seeds``). A value that holds commas (a list,
as ``sim.speeds`` takes) goes in brackets, which are not part of it; ``[]`` is the empty value:

    --sweep "sim.speeds=[],[1,1,0.5,0.5],[1,1,1,0.25]"

Seeds are integers in [0, 2**31). A bad flag, seed or sweep value is refused with one line
(exit status 2) before anything is trained or written.

Installed from a wheel the simulator is ``diloco_jax.sim``: run ``diloco-sim`` (or
``python -m diloco_jax.sim``) with the same flags.

Every ``--sweep`` adds a grid axis; every run uses ``parallel.runtime=sim``. Writes
``results.csv`` (a row per run), ``summary.csv`` (mean and spread over seeds), ``curves.png``,
``tradeoff.png`` and ``runs/<name>/metrics.jsonl``, and prints the table. Finished runs are not
recomputed when the command runs again.
"""

import sys

from diloco_jax import config as config_lib
from diloco_jax.base.commandline import ArgumentParser
from diloco_jax.config import cli


def _items(flag: str, values: list[str]) -> list[str]:
    """The comma-separated items of every use of ``flag``; an empty item is an error."""
    items = [item.strip() for value in values for item in value.split(",")]
    if "" in items:
        raise config_lib.ConfigError(f"{flag} {','.join(values)!r}: an empty item")
    return items


def _seeds(values: list[str]) -> list[int]:
    seeds = []
    for item in _items("--seeds", values):
        try:
            seed = int(item)
        except ValueError:
            seed = -1
        if not 0 <= seed < 2**31 or seed in seeds:
            why = "is listed twice" if seed in seeds else "is not an integer in [0, 2**31)"
            raise config_lib.ConfigError(f"--seeds: {item!r} {why}")
        seeds.append(seed)
    return seeds or [0]


def _sweep_flags(parser: ArgumentParser) -> None:
    group = parser.add_argument_group("sweep")
    group.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                       help="a grid axis: a key and its values ([a,b] holds a list)")  # fmt: skip
    group.add_argument("--baselines", action="append", default=[], metavar="NAMES",
                       help="also run these baselines: single, ddp (comma-separated)")  # fmt: skip
    group.add_argument("--seeds", action="append", default=[], metavar="S1,S2,...",
                       help="seeds, integers in [0, 2**31) (default: 0)")  # fmt: skip


def main(argv: list[str] | None = None, *, prog: str = f"python -m {__package__}") -> int:
    argv = sys.argv[1:] if argv is None else argv
    parsed = cli.parse(argv, prog=prog, description=__doc__, extend=_sweep_flags)
    if parsed is None:
        return 0
    from .sweep import format_table, sweep

    flags = parsed.flags
    try:
        seeds, baselines = _seeds(flags.seeds), _items("--baselines", flags.baselines)
        table = sweep(parsed.cfg, parsed.workdir, sweeps=flags.sweep, baselines=baselines,
                      seeds=seeds)  # fmt: skip
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if table:
        print(format_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
