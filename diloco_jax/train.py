"""Train a model with DiLoCo (or a baseline): ``python -m diloco_jax.train`` (``diloco-train``).

    python -m diloco_jax.train [--config NAME|PATH] [--workdir DIR] [--config.KEY=VALUE ...]

Writes ``metrics.jsonl``, TensorBoard events, ``run_record.jsonl``, ``config.json``
(``config_history.jsonl`` on later starts) and orbax checkpoints into the workdir (W&B's too with
``log.wandb``: ``diloco_jax/watch/records.py``), and resumes from the workdir's latest checkpoint
if there is one (a config that changes the training is refused: see ``diloco_jax/run/resume.py``).
"""

from __future__ import annotations

import pathlib
import shlex
import sys
import time

import jax

from diloco_jax import config as config_lib
from diloco_jax.base import commandline
from diloco_jax.base.commandline import ArgumentParser
from diloco_jax.base.extras import MissingExtra
from diloco_jax.config import cli, user_optimizers
from diloco_jax.data import DataError
from diloco_jax.learners.service import RefusedBySyncer, SyncerUnreachable
from diloco_jax.run import distributed, loop, placement, programs
from diloco_jax.run.preemption import Preemption, stopped, watch_launcher
from diloco_jax.run.setup import build, chunk_control
from diloco_jax.runtime import checkpoint
from diloco_jax.watch import figures, reporting

__all__ = ["dry_run", "main", "train"]


def train(cfg: config_lib.Config, workdir: str | pathlib.Path, *, show_progress: bool = True,
          allow_config_change: bool = False, server=None, task=None, inner=None, outer=None,
          since_start: float = 0.0):  # fmt: skip
    """Trains ``cfg`` into ``workdir`` (resuming from its newest readable checkpoint; keys that
    change the training must match its config unless ``allow_config_change``); returns a
    summary dict (final eval loss, steps, tokens, time, sample, and the final ``state``).

    SIGTERM or SIGINT stops the run at the next call boundary, with a checkpoint if
    ``train.checkpoint`` (``summary["preempted"]``); a second signal exits at once. With
    ``serve.port`` the run serves its status and control (:mod:`diloco_jax.watch.serve`),
    through ``server`` if given (a sweep's). ``task``: a user's ArrayTask or GrainTask (else
    ``task.factory``'s or the built-in task of ``data.corpus``); ``inner``, ``outer``: the
    user's own optax transforms (else the config's). ``since_start``: seconds the process
    spent before this call (the command's imports), in ``summary["phases"]["start"]``."""
    entered, phases = time.perf_counter(), reporting.Phases()
    given = user_optimizers.Given(inner, outer)
    s = build(cfg, task=task, given=given)  # first: it sets the CPU's device count
    workdir = pathlib.Path(workdir)
    if loop.draws(s):
        figures.start_helper()  # imports matplotlib on another core while this one compiles
    r, start = loop.open_run(s, workdir, allow_config_change=allow_config_change, server=server)
    phases.seconds["start"] = since_start + time.perf_counter() - entered
    own_code = task is not None or given != user_optimizers.NONE  # not kept as a program
    with Preemption(loop.stop_plan(s.cfg)) as stop:  # from the compile on: said at once
        run, loaded = loop.compile_step(s, start.state, phases,
                                        None if own_code else programs.material(s.cfg))  # fmt: skip
        total = loop.total_steps(s.cfg)
        user_task = task is not None or bool(s.cfg.task.factory)
        if int(start.state.step) == 0 and loop.eval_at_start(s.cfg, user_task=user_task):
            with phases("eval"):
                loop.evaluate(s, r.runlog, start.state, 0, total)
        calls = loop.run_calls(s, r, run, start.state, total, stop, phases,
                               show_progress=show_progress)  # fmt: skip
        summary = loop.finish(s, calls, r.mngr, workdir, preempted=stop.requested,
                              controls=r.live.changed, phases=phases)  # fmt: skip
        summary["step_from_cache"] = loaded
    loop.close(s, r, summary, calls.step, calls.call_seconds, calls.host_seconds, phases)
    return {**summary, "state": calls.state}


def dry_run(cfg: config_lib.Config) -> int:
    """``--dry_run``: prints the layout and the memory plan, compiled from shapes (nothing is
    allocated); returns 0, or raises ConfigError if the run would not fit."""
    s = build(cfg, abstract=True)
    args = (s.state, s.replicas_R, s.shards_RxS, chunk_control(cfg, s, 0))
    plan = placement.memory_plan(s, s.run_chunk.lower(*args).compile())
    print(f"{cfg.algorithm}: {s.layout}, {s.num_params:,} params\n{plan.table()}")
    placement.check_fits(plan, s)
    return 0


def _train_flags(parser: ArgumentParser) -> None:
    parser.add_argument("--dry_run", action="store_true",
                        help="print the layout and the memory plan per device (compiled from "
                        "shapes, nothing allocated) and exit: 0 if it fits, 2 if not")  # fmt: skip


def main(argv: list[str] | None = None, *, prog: str = "python -m diloco_jax.train") -> int:
    launched = watch_launcher() is not None  # started by diloco_jax.launch: stop when it dies
    args = cli.parse(sys.argv[1:] if argv is None else argv, prog=prog, distributed=True,
                     resume=True, description=__doc__, extend=_train_flags)  # fmt: skip
    if args is None:
        return 0
    cfg, workdir = args.cfg, args.workdir
    given = sys.argv[1:] if argv is None else argv
    # what continues this run: the launcher's own command for a process it started
    again = ("the launcher's command again" if launched else
             commandline.rerun(shlex.split(prog), given, workdir))  # fmt: skip
    try:
        distributed.initialize(args.cluster)
        placement.split_cpu(cfg)  # before anything starts JAX
        if args.flags.dry_run:
            return dry_run(cfg)
        if jax.process_count() > 1 and not args.workdir_given:
            raise config_lib.ConfigError(
                "a run of several processes needs --workdir (a directory every process can reach)"
            )
        if not args.workdir_given and cfg.train.checkpoint and jax.process_index() == 0:
            print(f"workdir {workdir}; to continue this run after a stop:\n  {again}",
                  file=sys.stderr)  # fmt: skip
        summary = train(cfg, workdir, allow_config_change=args.allow_config_change,
                        since_start=reporting.process_seconds() or 0.0)  # fmt: skip
    except (config_lib.ConfigError, DataError, checkpoint.CheckpointError, MissingExtra,
            RefusedBySyncer) as e:  # fmt: skip
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SyncerUnreachable as e:
        print(f"error: {e}; to continue: {again}", file=sys.stderr)
        return 1
    except distributed.ConsistencyError as e:
        print(f"error: {e}; stopped without saving (to continue from the last checkpoint: "
              f"{again})", file=sys.stderr)  # fmt: skip
        return 1
    if jax.process_index() != 0:
        return 0
    if summary["preempted"]:
        print("\n" + stopped(summary, workdir, cfg.train.checkpoint, again))
        return 0
    print(reporting.final_lines(summary, workdir))
    return 0


if __name__ == "__main__":
    reporting.exit_quickly(main())
