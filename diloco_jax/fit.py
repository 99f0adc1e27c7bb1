"""``fit``: a user's task trained with DiLoCo from Python (a script, a notebook), through the
same loop as ``python -m diloco_jax.train``: simulator or mesh, checkpoints and exact resume,
logs, TensorBoard, the served dashboard."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import optax

from diloco_jax import config as config_lib
from diloco_jax.tasks import UserTask


class FitResult(NamedTuple):
    """``params``: the outer (anchor) parameters at the end, on the host; ``eval_loss``: their
    final evaluation; ``history``: every event of the run's ``metrics.jsonl`` (train, eval,
    sync, ...), resumed runs' included; ``summary``: what ``train`` returned (steps, tokens,
    seconds, ...; the final replica-stacked ``state`` on the devices)."""

    params: Any
    eval_loss: float
    history: list[dict]
    summary: dict


def make_config(config: config_lib.Config | str | None = None,
                overrides: dict[str, Any] | None = None) -> config_lib.Config:  # fmt: skip
    """A validated Config: ``config`` (a Config, a preset's name or path; None: ``tiny``) with
    ``overrides`` (``{"outer.sync_every": 10}``), each parsed as its key's type. Raises
    ConfigError naming a bad key or value."""
    if not isinstance(config, config_lib.Config):
        config = config_lib.load_preset(config or "tiny")
    for key, value in (overrides or {}).items():
        text = json.dumps(value) if isinstance(value, (bool, dict)) else str(value)
        config = config_lib.override(config, key, text)
    config_lib.validate(config)
    return config


def fit(task: UserTask, config: config_lib.Config | str | None = None, *,
        workdir: str | pathlib.Path, overrides: dict[str, Any] | None = None,
        inner: optax.GradientTransformation | None = None,
        outer: optax.GradientTransformation | None = None,
        show_progress: bool = True, allow_config_change: bool = False) -> FitResult:  # fmt: skip
    """Trains ``task`` with DiLoCo under ``config`` into ``workdir``, resuming from its newest
    checkpoint as the command line does. ``config``: a Config, a preset's name or path (None:
    ``tiny``, the command line's default), with ``overrides`` (``{"outer.sync_every": 10}``,
    each parsed as its key's type). ``inner`` / ``outer``: your own optax transforms, in place
    of the config's AdamW and Nesterov SGD (``inner.*`` / ``outer.*`` optimizer keys then do
    not apply; a resume with another transform is refused like a changed learning rate:
    :mod:`diloco_jax.config.user_optimizers`). Raises ConfigError or
    :class:`~diloco_jax.tasks.TaskError` (one line naming what is wrong) before compiling."""
    from diloco_jax.train import train  # it sets the CPU's device count before JAX starts

    cfg = make_config(config, overrides)
    if outer is not None and cfg.syncer.address:
        raise config_lib.ConfigError(
            "a learner (syncer.address) takes the syncer's outer step, so the outer transform "
            "given to fit() would not be used: set the outer.* keys of the syncer and learners"
        )
    summary = train(cfg, workdir, show_progress=show_progress, task=task, inner=inner,
                    outer=outer, allow_config_change=allow_config_change)  # fmt: skip
    path = pathlib.Path(workdir) / "metrics.jsonl"
    history = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    params = summary.get("params")
    return FitResult(None if params is None else jax.device_get(params),
                     summary["final_eval_loss"], history, summary)  # fmt: skip


def sweep(task: UserTask, config: config_lib.Config | str | None = None, *,
          workdir: str | pathlib.Path, sweeps: list[str], seeds: Sequence[int] = (0,),
          baselines: Sequence[str] = (), overrides: dict[str, Any] | None = None,
          inner: optax.GradientTransformation | None = None,
          outer: optax.GradientTransformation | None = None,
          show_progress: bool = True) -> list[dict]:  # fmt: skip
    """``python -m sim``'s sweep of ``task`` from Python: one run per value of each sweep
    (``"outer.sync_every=10,50"``, as ``--sweep`` on the command line) and per seed, plus the
    ``baselines`` (``single``, ``ddp``). Returns the summary table (a row per group: the final
    eval loss's mean and spread over seeds, bytes, simulated time), also written with the
    figures into ``workdir``. ``config``, ``overrides``, ``inner`` and ``outer`` as for
    :func:`fit`. A finished run of the same config, task and optimizers is reused."""
    from diloco_jax.commands import _simulator

    base = make_config(config, overrides)
    return _simulator("sweep").sweep(base, pathlib.Path(workdir), sweeps=list(sweeps),
                                     baselines=list(baselines), seeds=list(seeds),
                                     show_progress=show_progress, task=task, inner=inner,
                                     outer=outer)  # fmt: skip
