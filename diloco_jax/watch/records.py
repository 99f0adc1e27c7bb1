"""The run record: what ran, where and from which code, one line per start of a workdir.

``workdir/run_record.jsonl`` gets one JSON object each time ``train`` starts in the workdir (a
fresh start or a resume): ``time``, ``step`` (where it starts), ``command`` (the command line to
paste to run it again: for ``python -m diloco_jax.train``, in the same workdir, so it continues
from the newest checkpoint), ``argv`` (``sys.argv`` as it was),
``cwd``, ``hostname``, ``python``, ``git`` (the commit of the checkout diloco-jax runs from and
whether it had uncommitted changes; null when it runs from an installed wheel or git is
missing), ``packages`` (versions, null for one not installed) and ``devices`` (platform, kind,
counts). The config in effect is in ``config.json`` / ``config_history.jsonl``
(``diloco_jax/run/resume.py``). :func:`open_runlog` also opens the run's logs from the config.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import platform
import socket
import subprocess
import sys
import time
from typing import Any

import jax

from diloco_jax import config as config_lib
from diloco_jax.base import commandline
from diloco_jax.watch import reporting

# the programs whose command line, given a workdir, continues the run there
TRAIN_COMMANDS = (["python", "-m", "diloco_jax.train"], ["diloco-train"])

PACKAGES = ("diloco-jax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy",
            "tensorboardx", "wandb")  # fmt: skip
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]


def git_state(package_dir: pathlib.Path = _PACKAGE_DIR) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the git checkout whose ``diloco_jax/`` is
    ``package_dir``; None if it is not one (an installed wheel, even inside some repository) or
    git fails. Never raises."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(package_dir), *args], capture_output=True,
                              text=True, timeout=10, check=True)  # fmt: skip
        return done.stdout.strip()

    try:
        top = pathlib.Path(git("rev-parse", "--show-toplevel")).resolve()
        if top / package_dir.name != package_dir.resolve():
            return None
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def devices() -> dict[str, Any]:
    """The devices JAX sees: every process's together, and this process's."""
    all_devices = jax.devices()
    return {
        "platform": all_devices[0].platform,
        "kind": all_devices[0].device_kind,
        "count": len(all_devices),
        "local_count": jax.local_device_count(),
        "process_count": jax.process_count(),
    }


def run_record(step: int, workdir: pathlib.Path | None = None) -> dict[str, Any]:
    """This start's record (see the module docstring); ``workdir``: the run's, which
    ``command`` names when this process is a training command."""
    prog = commandline.program(sys.argv[0] if sys.argv else "")
    if prog not in TRAIN_COMMANDS:  # a sweep, fit, a test
        workdir = None
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "step": step,
        "command": commandline.rerun(prog, sys.argv[1:], workdir),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "git": git_state(),
        "packages": package_versions(),
        "devices": devices(),
    }


def append(workdir: pathlib.Path, step: int) -> dict[str, Any]:
    """Appends this start's record to ``workdir/run_record.jsonl``; returns it."""
    workdir.mkdir(parents=True, exist_ok=True)
    record = run_record(step, workdir)
    with open(workdir / "run_record.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def open_runlog(cfg: config_lib.Config, workdir: pathlib.Path, start_step: int, *,
                enabled: bool) -> reporting.RunLog:  # fmt: skip
    """The run's :class:`reporting.RunLog` (``enabled``: the process that writes): the
    resolved config as TensorBoard hparams, a :class:`reporting.WandbWriter` if ``log.wandb``;
    appends the run record first."""
    if not enabled:
        return reporting.RunLog(workdir, enabled=False)
    append(workdir, start_step)
    sinks: tuple = ()
    lg = cfg.log
    if lg.wandb:
        writer = reporting.WandbWriter(workdir, project=lg.wandb_project, mode=lg.wandb_mode,
                                       config=config_lib.to_dict(cfg))  # fmt: skip
        sinks = (writer,)
    return reporting.RunLog(workdir, start_step=start_step, hparams=config_lib.keys(cfg),
                            sinks=sinks)  # fmt: skip
