"""Command lines: one argparse style for every entry point, with one-line errors.

Train and the simulator take a preset and overrides, the convention of JAX projects
(``--config NAME|PATH --config.KEY=VALUE``); every config key is a real flag, typed and described
in ``--help`` with the chosen preset's value. Resuming adds ``--allow_config_change``; a
multi-process run adds the cluster flags (``diloco_jax/run/distributed.py``). Errors are one line,
``error: ...``, exit status 2, before anything is loaded, compiled or written.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import textwrap
import time
from collections.abc import Callable
from typing import NamedTuple

from diloco_jax.base.commandline import ArgumentParser, check_output_dir
from diloco_jax.base.errors import ConfigError
from diloco_jax.config import dotted, presets, validation
from diloco_jax.config import schema as config_lib

Extend = Callable[[ArgumentParser], None]  # adds an entry point's own flags
_METAVAR = {bool: "BOOL", int: "INT", float: "FLOAT", str: "TEXT"}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins a run. ``None`` fields are read from the environment."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    mode: str = "auto"  # auto: join when flags, env or a SLURM/MPI job say so; on: always; off
    timeout_s: int = 300  # how long to wait for every process to join


class Args(NamedTuple):
    cfg: config_lib.Config
    workdir: pathlib.Path
    cluster: Cluster
    workdir_given: bool  # False: the default, runs/<preset>-<date>-<time>
    allow_config_change: bool = False
    flags: argparse.Namespace = argparse.Namespace()  # the entry point's own flags


def _bool(text: str) -> bool:
    try:
        return dotted.parse_value(text, bool, "")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a bool (use true or false)") from None


def _typed(kind: type) -> Callable[[str], object]:
    def parse(text: str):
        if kind is bool:
            return _bool(text)
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {_METAVAR[kind].lower()}") from None

    parse.__name__ = kind.__name__
    return parse


def _section_doc(cfg: config_lib.Config, section: str) -> str | None:
    """A config section's own docstring, wrapped (None for the generated ones)."""
    if not section:
        return None
    kind = type(getattr(cfg, section))
    doc = kind.__doc__ or ""
    if not doc or doc.startswith(kind.__name__):
        return None
    text = " ".join(doc.replace("``", "").split())
    return textwrap.fill(text, 94)


def _add_config_keys(parser: ArgumentParser, cfg: config_lib.Config) -> None:
    """A typed ``--config.KEY`` flag for every key, one group per section, described with the
    preset's value."""
    groups = {}
    for key, leaf in dotted.described(cfg).items():
        section = key.rpartition(".")[0]
        if section not in groups:
            title = f"config keys: {section or 'top level'}"
            groups[section] = parser.add_argument_group(title, _section_doc(cfg, section))
        about = f"{leaf.about} (preset: {leaf.value!r})".replace("%", "%%")
        groups[section].add_argument(
            f"--config.{key}", dest=key, type=_typed(leaf.kind), metavar=_METAVAR[leaf.kind],
            default=argparse.SUPPRESS, help=about,
        )  # fmt: skip


def _add_cluster_flags(parser: ArgumentParser) -> None:
    group = parser.add_argument_group(
        "multi-process runs (diloco_jax/run/distributed.py; each also read from its JAX_* variable)"
    )
    group.add_argument("--coordinator_address", metavar="HOST:PORT",
                       help="process 0's address (JAX_COORDINATOR_ADDRESS)")  # fmt: skip
    group.add_argument("--num_processes", type=int, metavar="N",
                       help="processes in the run (JAX_NUM_PROCESSES)")  # fmt: skip
    group.add_argument("--process_id", type=int, metavar="I",
                       help="this process, 0..N-1 (JAX_PROCESS_ID)")  # fmt: skip
    group.add_argument("--distributed", default="auto", choices=("auto", "on", "off"),
                       help="on: let JAX detect the cluster (Cloud TPU, k8s)")  # fmt: skip
    group.add_argument("--init_timeout", type=int, default=300, metavar="SECONDS",
                       help="how long to wait for every process to join")  # fmt: skip


def _preset(argv: list[str]) -> str:
    """The ``--config`` value (a preset name or path), read before the full parser exists (its
    flags carry the preset's values)."""
    first = ArgumentParser(add_help=False)
    first.add_argument("--config", default=str(config_lib.DEFAULT_PRESET))
    return first.parse_known_args(argv)[0].config


def parser_for(prog: str, cfg: config_lib.Config, *, description: str = "",
               distributed: bool = False, resume: bool = False,
               extend: Extend | None = None) -> ArgumentParser:  # fmt: skip
    """The parser of an entry point that trains: ``--config``, ``--workdir``, the resume and
    cluster flags where asked, the entry point's own (``extend``), then every config key."""
    usage = f"{prog} [-h] [--config NAME|PATH] [--workdir DIR] [--config.KEY=VALUE ...]"
    if resume or distributed or extend:
        usage += " [more flags below]"
    parser = ArgumentParser(prog=prog, usage=usage, description=description, add_help=False)
    run = parser.add_argument_group("run")
    run.add_argument("-h", "--help", action="store_true", help="this text")
    run.add_argument("--config", metavar="NAME|PATH", default=str(config_lib.DEFAULT_PRESET),
                     help="a preset by name (" + ", ".join(presets.names()) + ") or a file with "
                     "get_config() (default: default)")  # fmt: skip
    run.add_argument("--workdir", metavar="DIR",
                     help="output directory (default: runs/<preset>-<date>-<time>)")  # fmt: skip
    if resume:
        run.add_argument("--allow_config_change", type=_bool, nargs="?", const=True,
                         default=False, metavar="BOOL",
                         help="resume although keys that change the training differ from the "
                         "checkpoint's (each change is logged and recorded)")  # fmt: skip
    if distributed:
        _add_cluster_flags(parser)
    if extend:
        extend(parser)
    _add_config_keys(parser, cfg)
    return parser


def parse(argv: list[str], *, prog: str, description: str = "", distributed: bool = False,
          resume: bool = False, extend: Extend | None = None
          ) -> Args | None:  # fmt: skip
    """Returns ``Args(config, workdir, cluster, ...)``, or None after printing help. Exits with
    status 2 and a one-line error on bad input. ``distributed``: accept the multi-process flags;
    ``resume``: accept ``--allow_config_change``; ``extend`` adds the entry point's own flags
    (their values: ``Args.flags``)."""
    try:
        preset = _preset(argv)
        cfg = dotted.load_preset(preset)
        parser = parser_for(prog, cfg, description=description, distributed=distributed,
                            resume=resume, extend=extend)  # fmt: skip
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    ns = parser.parse_args(argv)
    if ns.help:
        parser.print_help()
        return None
    try:
        for key in dotted.keys(cfg).keys() & vars(ns).keys():
            cfg = dotted.replace(cfg, key, getattr(ns, key))
        validation.validate(cfg)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        default = f"runs/{pathlib.Path(preset).stem}-{stamp}"
        workdir = check_output_dir(default if ns.workdir is None else ns.workdir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    cluster = Cluster(**{name: getattr(ns, name) for name in ("coordinator_address",
                         "num_processes", "process_id")}, mode=ns.distributed,
                      timeout_s=ns.init_timeout) if distributed else Cluster()  # fmt: skip
    own = {action.dest for action in parser._actions} - set(dotted.keys(cfg))
    flags = argparse.Namespace(**{k: v for k, v in vars(ns).items() if k in own})
    return Args(cfg, workdir, cluster, ns.workdir is not None,
                getattr(ns, "allow_config_change", False), flags)  # fmt: skip
