"""What every command's line shares: an argparse whose errors are one line and exit 2, the
check that an output directory can be written before anything starts, and the command line that
runs a command again (to continue a run)."""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import shlex
import sys

from diloco_jax.base.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``error: ...``, and exit status 2 (argparse's own
    prints the usage first); no flag abbreviations; unknown flags name the closest known one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"error: {message} (--help for usage)", file=sys.stderr)
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if "--" in args:  # nothing here takes positionals after it
            self.error("unexpected argument '--'")
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown(extras[0]))
        return namespace

    def unknown(self, arg: str) -> str:
        """One line about an argument no flag takes, with the closest flag when one is close."""
        if not arg.startswith("-"):
            return f"unexpected argument {arg!r}"
        name = arg.partition("=")[0]
        close = difflib.get_close_matches(name, self._option_string_actions, n=1)
        if name.startswith("--config."):  # a config key: named as the config names it
            hint = f"; did you mean {close[0].removeprefix('--config.')}?" if close else ""
            return f"unknown config key {name.removeprefix('--config.')!r}{hint}"
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"unknown flag {name}{hint}"


def program(argv0: str, main: object = None) -> list[str]:
    """How the program of this process is typed: ``python -m NAME`` when it was started with
    ``-m`` (the ``main`` module's spec names the module; default: ``__main__``), the bare name
    of a console script on the PATH (``diloco-train``), else ``python ARGV0`` (a script;
    ``-c`` code: ``python -c``)."""
    main = sys.modules.get("__main__") if main is None else main
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return ["python", "-m", spec.name.removesuffix(".__main__")]
    if argv0.endswith(".py") or argv0 in ("-c", ""):
        return ["python", argv0 or "-c"]
    return [pathlib.Path(argv0).name]


UV_RUN = "UV_RUN_RECURSION_DEPTH"  # set by ``uv run`` in the process it starts


def rerun(prog: list[str], args: list[str], workdir: str | os.PathLike | None = None,
          environ=os.environ) -> str:  # fmt: skip
    """The command line, to paste into a shell, that runs ``prog`` with ``args`` again; with
    ``workdir``, in that workdir (any ``--workdir`` of ``args`` replaced), which a training
    command continues from its newest checkpoint. After ``uv run`` when ``uv run`` started this
    process (``environ`` says so): its environment is uv's, which a shell has not activated."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif workdir is not None and arg == "--workdir":
            skip = True
        elif workdir is None or not arg.startswith("--workdir="):
            kept.append(arg)
    where = [] if workdir is None else ["--workdir", str(workdir)]
    uv = ["uv", "run"] if environ.get(UV_RUN) and prog[:1] != ["uv"] else []
    return shlex.join([*uv, *prog, *kept, *where])


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=42, width=100)


def check_output_dir(path: str | os.PathLike, flag: str = "--workdir") -> pathlib.Path:
    """``path`` if a run can write there: a directory, or a path whose nearest existing ancestor
    is a writable directory (nothing is created here). Raises :class:`ConfigError`, one line
    naming ``flag``, otherwise."""
    if not str(path).strip():
        raise ConfigError(f"{flag} is empty: give a directory")
    path = pathlib.Path(path).expanduser()
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not os.path.lexists(existing):  # a relative path in a missing working directory
        existing = pathlib.Path.cwd()
    where = f"{flag} {path}" + ("" if existing == path else f": parent {existing}")
    if not existing.is_dir():
        kind = "a file" if existing.is_file() else "not a directory"
        raise ConfigError(f"{where} is {kind}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable")
    return path
