"""Command-line parsing shared by the entry points: a preset, overrides and a workdir.

--config PATH            preset file with get_config() (default: configs/default.py)
--config.KEY=VALUE       override one key, e.g. --config.outer.sync_every=50
--workdir DIR            output directory (default: runs/<preset>-<date>-<time>)
--help                   this text and every config key with its value
"""

from __future__ import annotations

import pathlib
import sys
import time

from diloco_jax import config as config_lib


def _usage(prog: str, cfg: config_lib.Config) -> str:
    lines = [f"usage: {prog} [--config PATH] [--workdir DIR] [--config.KEY=VALUE ...]", ""]
    lines += [line.strip() for line in __doc__.splitlines()[2:7]]
    lines += ["", "config keys (value in the chosen preset):"]
    lines += [f"  {key} = {value!r}" for key, value in config_lib.keys(cfg).items()]
    return "\n".join(lines)


def _split(argv: list[str]) -> tuple[dict[str, str], list[tuple[str, str]], bool]:
    """Splits argv into plain flags, config overrides and whether help was asked for."""
    flags, overrides, want_help = {}, [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            want_help = True
            i += 1
            continue
        if not arg.startswith("--"):
            raise config_lib.ConfigError(f"unexpected argument {arg!r} (flags start with --)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise config_lib.ConfigError(f"flag --{name} needs a value")
            value, i = argv[i + 1], i + 1
        if name.startswith("config."):
            overrides.append((name[len("config.") :], value))
        elif name in ("config", "workdir"):
            flags[name] = value
        else:
            raise config_lib.ConfigError(
                f"unknown flag --{name} (known: --config, --workdir, --config.KEY=VALUE)"
            )
        i += 1
    return flags, overrides, want_help


def parse(argv: list[str], *, prog: str) -> tuple[config_lib.Config, pathlib.Path] | None:
    """Returns ``(config, workdir)``, or None after printing help. Exits with status 2 and a
    one-line error on bad input."""
    try:
        flags, overrides, want_help = _split(argv)
        preset = pathlib.Path(flags.get("config", config_lib.DEFAULT_PRESET))
        cfg = config_lib.load_preset(preset)
        if want_help:
            print(_usage(prog, cfg))
            return None
        cfg = config_lib.apply_overrides(cfg, overrides)
        config_lib.validate(cfg)
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = pathlib.Path(flags.get("workdir", f"runs/{preset.stem}-{stamp}"))
    return cfg, workdir
