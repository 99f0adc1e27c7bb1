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
    """What :func:`fit` returns: the trained parameters and the run's record.

    Attributes:
      params: the outer (anchor) parameters at the end, on the host.
      eval_loss: their final evaluation's ``eval_loss``.
      history: every event of the run's ``metrics.jsonl`` (train, eval, sync, ...), those of
        the runs it resumed included.
      summary: what the training loop returned: steps, tokens, seconds, ..., and the final
        replica-stacked ``state``, on the devices.
    """

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
    """Trains ``task`` with DiLoCo into ``workdir``, through the same loop as ``python -m
    diloco_jax.train``: simulator or mesh, checkpoints, logs, TensorBoard, the dashboard.

    A ``workdir`` that holds a checkpoint is resumed from its newest one, as the command line
    does; a resume that would change the training (another config value, another optimizer) is
    refused unless ``allow_config_change``.

    Args:
      task: the task to train: an :class:`~diloco_jax.ArrayTask` or a
        :class:`~diloco_jax.GrainTask`.
      config: a :class:`~diloco_jax.config.Config`, or a preset's name or path (None:
        ``tiny``, 20 steps; the command line's default preset is ``default``, 1000 steps).
      workdir: the run's directory: checkpoints, ``metrics.jsonl``, figures.
      overrides: config keys to change, ``{"outer.sync_every": 10}``, each value parsed as its
        key's type (the :doc:`configuration reference </_generated/configuration>` lists them).
      inner: your own optax transform for the replicas' inner steps, in place of the config's
        AdamW (the ``inner.*`` optimizer keys then do not apply).
      outer: your own optax transform for the outer step, in place of the config's Nesterov
        SGD (the ``outer.*`` optimizer keys then do not apply).
      show_progress: show a progress bar (where ``log.progress_bar`` is on).
      allow_config_change: resume even where the config differs from the checkpoint's,
        logging each change.

    Returns:
      The :class:`FitResult`, with the final outer parameters, their evaluation and the
      run's events.

    Raises:
      ~diloco_jax.config.ConfigError: a config key or value is invalid, or a resume would change
        the training (before anything is compiled).
      TaskError: the task's parameters, loss, data or evaluation cannot be trained (one line
        naming what is wrong, before anything is compiled).
    """
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
    """Compares settings on ``task``: ``python -m sim``'s sweep, from Python.

    One run per value of each sweep and per seed, plus the baselines, each in its own
    directory under ``workdir``. A finished run of the same config, task and optimizers is
    reused, so an interrupted sweep resumes where it stopped.

    Args:
      task: the task to train, as for :func:`fit`.
      config: the base config, as for :func:`fit`.
      workdir: the sweep's directory: one run per directory, the summary table and figures.
      sweeps: the settings to compare, as ``--sweep`` on the command line:
        ``["outer.sync_every=10,50"]`` runs once per value.
      seeds: the seeds to run each setting with.
      baselines: also run these baselines: ``"single"`` (one replica), ``"ddp"`` (data
        parallelism).
      overrides: config keys to change in every run, as for :func:`fit`.
      inner: your own inner optax transform, as for :func:`fit`.
      outer: your own outer optax transform, as for :func:`fit`.
      show_progress: show each run's progress bar.

    Returns:
      The summary table, one dict per group of runs that differ only in their seed, with
      the final eval loss's mean and spread over the seeds, the bytes sent and the simulated
      time. It is also written with the figures into ``workdir``.

    Raises:
      ~diloco_jax.config.ConfigError: a config key or value, a sweep, the seeds or a baseline
        is invalid.
      TaskError: the task cannot be trained (see :func:`fit`).
    """
    from diloco_jax.commands import _simulator

    base = make_config(config, overrides)
    return _simulator("sweep").sweep(base, pathlib.Path(workdir), sweeps=list(sweeps),
                                     baselines=list(baselines), seeds=list(seeds),
                                     show_progress=show_progress, task=task, inner=inner,
                                     outer=outer)  # fmt: skip
