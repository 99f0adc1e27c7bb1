"""The console scripts that installing diloco-jax puts on the PATH (``[project.scripts]``):

    diloco-train     python -m diloco_jax.train
    diloco-sim       python -m sim             (installed: python -m diloco_jax.sim)
    diloco-combine   python -m sim.combine     (installed: python -m diloco_jax.sim.combine)
    diloco-prepare   python -m diloco_jax.data.prepare
    diloco-launch    python -m diloco_jax.launch
    diloco-syncer    python -m diloco_jax.syncer

Each takes the same flags as its module and returns its exit status.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def _simulator(module: str) -> ModuleType:
    """A module of the simulator. A wheel ships the repository's top-level ``sim/`` as
    ``diloco_jax.sim`` (no generic top-level name in site-packages); a checkout, and an editable
    install of it, has it as ``sim``."""
    package = "diloco_jax.sim" if importlib.util.find_spec("diloco_jax.sim") else "sim"
    return importlib.import_module(f"{package}.{module}")


def train() -> int:
    from diloco_jax.train import main
    from diloco_jax.watch.reporting import exit_quickly

    exit_quickly(main(prog="diloco-train"))  # as python -m diloco_jax.train ends
    return 0  # not reached


def simulate() -> int:
    return _simulator("__main__").main(prog="diloco-sim")


def combine() -> int:
    return _simulator("combine").main(prog="diloco-combine")


def prepare() -> int:
    from diloco_jax.data.prepare import main

    return main(prog="diloco-prepare")


def launch() -> int:
    from diloco_jax.launch import main

    return main()


def syncer() -> int:
    from diloco_jax.syncer import main

    return main(prog="diloco-syncer")
