"""Command-line parsing shared by the entry points: a preset, overrides and a workdir.

--config NAME|PATH       a preset by name (tiny; the list below) or a file with get_config()
                         (default: default)
--config.KEY=VALUE       override one key, e.g. --config.outer.sync_every=50
--workdir DIR            output directory (default: runs/<preset>-<date>-<time>)
--help                   this text and every config key with its value

Resuming a workdir (``python -m diloco_jax.train`` only; see diloco_jax/resume.py):
--allow_config_change    resume although keys that change the training differ from the
                         checkpoint's config (each change is logged and recorded)

Multi-process runs (``python -m diloco_jax.train`` only; see diloco_jax/distributed.py):
--coordinator_address HOST:PORT   process 0's address (or JAX_COORDINATOR_ADDRESS)
--num_processes N                 processes in the run (or JAX_NUM_PROCESSES)
--process_id I                    this process, 0..N-1 (or JAX_PROCESS_ID)
--distributed auto|on|off         on: let JAX detect the cluster (Cloud TPU, k8s); default auto
--init_timeout SECONDS            how long to wait for every process to join (default 300)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from typing import NamedTuple

from diloco_jax import config as config_lib
from diloco_jax import presets
from diloco_jax.distributed import Cluster

_SWITCHES = ("allow_config_change",)
_CLUSTER_FLAGS = {
    "coordinator_address": str, "num_processes": int, "process_id": int, "distributed": str,
    "init_timeout": int,
}  # fmt: skip


class Args(NamedTuple):
    cfg: config_lib.Config
    workdir: pathlib.Path
    cluster: Cluster
    workdir_given: bool  # False: the default, runs/<preset>-<date>-<time>
    allow_config_change: bool = False


def _usage(prog: str, cfg: config_lib.Config, distributed: bool, resume: bool) -> str:
    lines = [f"usage: {prog} [--config NAME|PATH] [--workdir DIR] [--config.KEY=VALUE ...]", ""]
    _, common, resuming, multi_process = __doc__.strip().split("\n\n")
    lines += common.splitlines()
    if resume:
        lines += ["", *resuming.splitlines()]
    if distributed:
        lines += ["", *multi_process.splitlines()]
    lines += ["", f"presets ({presets.DIRECTORY}):", "  " + ", ".join(presets.names())]
    lines += ["", "config keys (value in the chosen preset):"]
    lines += [f"  {key} = {value!r}" for key, value in config_lib.keys(cfg).items()]
    return "\n".join(lines)


def _split(argv: list[str], known: tuple[str, ...]):
    """Splits argv into plain flags, config overrides and whether help was asked for; a flag
    of :data:`_SWITCHES` takes no value (``--name`` is ``--name=true``)."""
    flags, overrides, want_help = {}, [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            want_help = True
            i += 1
            continue
        if not arg.startswith("--") or arg == "--":
            raise config_lib.ConfigError(f"unexpected argument {arg!r} (flags start with --)")
        name, eq, value = arg[2:].partition("=")
        if not eq and name in _SWITCHES:
            value = "true"
        elif not eq:
            if i + 1 >= len(argv):
                raise config_lib.ConfigError(f"flag --{name} needs a value")
            value, i = argv[i + 1], i + 1
        if name.startswith("config."):
            overrides.append((name[len("config.") :], value))
        elif name in known:
            flags[name] = value
        else:
            names = ", ".join(f"--{k}" for k in known)
            raise config_lib.ConfigError(
                f"unknown flag --{name} (known: {names}, --config.KEY=VALUE)"
            )
        i += 1
    return flags, overrides, want_help


def _cluster(flags: dict[str, str]) -> Cluster:
    values = {}
    for name, kind in _CLUSTER_FLAGS.items():
        if name in flags:
            try:
                values[name] = kind(flags[name])
            except ValueError:
                raise config_lib.ConfigError(
                    f"flag --{name} = {flags[name]!r} is invalid: must be an integer"
                ) from None
    if "distributed" in values:
        values["mode"] = values.pop("distributed")
    if "init_timeout" in values:
        values["timeout_s"] = values.pop("init_timeout")
    return Cluster(**values)


def _switch(flags: dict[str, str], name: str) -> bool:
    text = flags.get(name, "false").strip().lower()
    if text not in ("true", "false"):
        raise config_lib.ConfigError(
            f"flag --{name} = {flags[name]!r} is invalid: must be true or false"
        )
    return text == "true"


def check_output_dir(path: str | os.PathLike, flag: str = "--workdir") -> pathlib.Path:
    """``path`` if a run can write there: a directory, or a path whose nearest existing ancestor
    is a writable directory (nothing is created here). Raises :class:`ConfigError`, one line
    naming ``flag``, otherwise."""
    if not str(path).strip():
        raise config_lib.ConfigError(f"{flag} is empty: give a directory")
    path = pathlib.Path(path).expanduser()
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not os.path.lexists(existing):  # a relative path in a missing working directory
        existing = pathlib.Path.cwd()
    where = f"{flag} {path}" + ("" if existing == path else f": parent {existing}")
    if not existing.is_dir():
        kind = "a file" if existing.is_file() else "not a directory"
        raise config_lib.ConfigError(f"{where} is {kind}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise config_lib.ConfigError(f"{where} is not writable")
    return path


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``error: ...``, and exit status 2 (argparse's own
    prints the usage first)."""

    def error(self, message: str):
        print(f"error: {message} (--help for usage)", file=sys.stderr)
        sys.exit(2)


def parse(argv: list[str], *, prog: str, distributed: bool = False, resume: bool = False
          ) -> Args | None:  # fmt: skip
    """Returns ``Args(config, workdir, cluster, ...)``, or None after printing help. Exits with
    status 2 and a one-line error on bad input. ``distributed``: accept the multi-process flags;
    ``resume``: accept ``--allow_config_change``."""
    known = ("config", "workdir", *(_CLUSTER_FLAGS if distributed else ()),
             *(_SWITCHES if resume else ()))  # fmt: skip
    try:
        flags, overrides, want_help = _split(argv, known)
        preset = flags.get("config", config_lib.DEFAULT_PRESET)  # a name or a path
        cfg = config_lib.load_preset(preset)
        if want_help:
            print(_usage(prog, cfg, distributed, resume))
            return None
        cfg = config_lib.apply_overrides(cfg, overrides)
        config_lib.validate(cfg)
        cluster = _cluster(flags)
        allow_config_change = _switch(flags, "allow_config_change")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        workdir = check_output_dir(
            flags.get("workdir", f"runs/{pathlib.Path(preset).stem}-{stamp}")
        )
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return Args(cfg, workdir, cluster, "workdir" in flags, allow_config_change)
