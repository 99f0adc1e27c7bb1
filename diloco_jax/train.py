"""Train a model with DiLoCo (or a baseline): ``python -m diloco_jax.train`` (``diloco-train``).

    python -m diloco_jax.train [--config NAME|PATH] [--workdir DIR] [--config.KEY=VALUE ...]

Writes ``metrics.jsonl``, TensorBoard events, ``run_record.jsonl``, ``config.json``
(``config_history.jsonl`` on later starts) and orbax checkpoints into the workdir (W&B's too with
``log.wandb``: ``diloco_jax/records.py``), and resumes from the workdir's latest checkpoint
if there is one (a config that changes the training is refused: see ``diloco_jax/resume.py``).
"""

from __future__ import annotations

import pathlib
import sys
import threading
import time
from typing import NamedTuple

import jax
import numpy as np

from diloco_jax import (
    cli,
    distributed,
    figures,
    placement,
    programs,
    records,
    reporting,
    resume,
    user_optimizers,
)
from diloco_jax import config as config_lib
from diloco_jax.data import DataError
from diloco_jax.extras import MissingExtra
from diloco_jax.live import Live
from diloco_jax.preemption import Preemption, saving, stopped, watch_launcher
from diloco_jax.reporting import log
from diloco_jax.run_setup import Setup, build, chunk_control
from diloco_jax.runtime import checkpoint, compile_cache, parallel
from diloco_jax.tasks.sample import generate_text

__all__ = ["Setup", "build", "chunk_control", "dry_run", "main", "train"]  # the first three:
# diloco_jax.run_setup's, kept here for the callers that import them from the loop's module


def outer_steps(cfg: config_lib.Config, step: int) -> int:
    """Syncs completed after ``step`` inner steps (ddp syncs every step, single never)."""
    return {"diloco": step // cfg.outer.sync_every, "ddp": step, "single": 0}[cfg.algorithm]


def _finish(s: Setup, state, step: int, eval_loss, seconds: float, mngr, workdir, preempted,
            controls: dict):  # fmt: skip
    """Final checkpoint, figures, outer params and text sample, the first two written in the
    background while the others are made; returns the run's summary (``preempted``: the name
    of the signal that stopped the run, or None; ``controls``: what was changed over HTTP,
    saved with the checkpoint)."""
    drawing = figures.draw_in_background(workdir) if _draws(s) else None
    if mngr is not None and mngr.latest_step() != step:  # written while the rest is made
        checkpoint.save(mngr, step, state, config_lib.to_dict(s.cfg), controls=controls,
                        data=s.data_states(), wait=False)  # fmt: skip
    try:
        return _outputs(s, state, step, eval_loss, seconds, workdir, preempted)
    finally:
        if drawing is not None:
            drawing.join()
        if mngr is not None:
            mngr.wait_until_finished()
            log.info("checkpoint saved: %s", workdir / "checkpoints" / str(step))


def _draws(s: Setup) -> bool:
    """Whether this process draws the run's drift.png and cosine.png (matplotlib)."""
    return jax.process_index() == 0 and s.cfg.log.figures


def _outputs(s: Setup, state, step: int, eval_loss, seconds: float, workdir, preempted):
    """The summary, the exported outer params and the text sample."""
    cfg = s.cfg
    summary = {
        "final_eval_loss": eval_loss,
        "steps": step,
        "outer_steps": outer_steps(cfg, step),
        "tokens": step * s.layout.replicas * cfg.data.batch_size * s.tokens_per_row,
        "unit": s.unit,  # what "tokens" counts
        "train_seconds": round(seconds, 2),
        "unigram_entropy": s.unigram_nats if s.unigram_nats > 0 else None,  # None: a user's
        "preempted": preempted,
    }
    if preempted:
        return summary
    summary["params"] = params = s.outer_fn(state)  # the outer parameters, on the devices
    checkpoint.save_params(workdir / "params", params)  # every process writes its part
    text_model = s.unit == "token" and s.graphdef is not None  # the built-in Transformer
    if cfg.train.sample_chars and text_model and jax.process_index() == 0:
        summary["sample"] = generate_text(
            s.graphdef, parallel.host_copy(params), cfg.train.sample_prompt,
            num_chars=cfg.train.sample_chars, seq_len=cfg.data.seq_len, seed=cfg.seed,
            tokenizer=s.tokenizer,
        )  # fmt: skip
    return summary


def _crossed(step: int, chunk: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``(step - chunk, step]``."""
    return every > 0 and step // every > (step - chunk) // every


def _report_chunk(s: Setup, runlog, bar, step: int, metrics_NxR, seconds: float) -> None:
    cfg, n = s.cfg, s.cfg.train.log_every
    if cfg.algorithm == "diloco":
        reporting.log_syncs(runlog, s.algorithm.plan, step - n, metrics_NxR)
    loss_R = metrics_NxR["loss"][-1]
    tokens_per_s = s.layout.replicas * cfg.data.batch_size * s.tokens_per_row * n / seconds
    outer = outer_steps(cfg, step)
    aux = {f"aux_{k}": float(v[-1].mean()) for k, v in metrics_NxR.get("aux", {}).items()}
    runlog.write("train", step, loss=float(loss_R.mean()), replica_loss=loss_R,
                 tokens_per_s=tokens_per_s, outer_steps=outer, **aux)  # fmt: skip
    bar.update(n)
    rate = {"tok_s" if s.unit == "token" else "ex_s": f"{tokens_per_s:,.0f}"}
    bar.set_postfix(loss=f"{loss_R.mean():.3f}", **rate, outer=outer)


def _evaluate(s: Setup, runlog, state, step: int, total: int) -> float:
    cfg = s.cfg
    result = jax.device_get(s.evaluate(s.outer_fn(state)))
    values = {k: float(v) for k, v in result.items()}
    eval_loss = values.pop("eval_loss")
    tokens = step * s.layout.replicas * cfg.data.batch_size * s.tokens_per_row
    outer = outer_steps(cfg, step)
    runlog.write("eval", step, eval_loss=eval_loss, outer_steps=outer, tokens=tokens, **values)
    extra = "".join(f", {k} {v:.4f}" for k, v in values.items())
    log.info("step %d/%d, outer step %d: eval_loss %.4f%s%s (outer params)", step, total, outer,
             eval_loss, " nats" * (s.unigram_nats > 0), extra)  # fmt: skip
    return eval_loss


def _eval_at_start(cfg: config_lib.Config, *, user_task: bool) -> bool:
    """``train.eval_at_start``: ``auto`` evaluates a user's task at step 0 (its curves then
    start at the initial loss); the built-in tasks' runs keep their first evaluation at
    ``train.eval_every``."""
    return cfg.train.eval_at_start == "true" or (cfg.train.eval_at_start == "auto" and user_task)


def _agree_to_stop(stop: Preemption) -> bool:
    """Whether any process got SIGTERM/SIGINT; every process asks after the same call, so all
    stop at the same step (one tiny all-gather per call when there are several processes)."""
    signalled = distributed.any_process(stop.requested is not None)
    if signalled and stop.requested is None:
        stop.requested = f"a signal to process {signalled[0]}"
    return bool(signalled)


class _Run(NamedTuple):
    """What a run writes to and is watched through."""

    lead: bool  # the process that logs and writes files
    mngr: object  # the checkpoint manager, or None (train.checkpoint=false)
    runlog: reporting.RunLog
    live: Live


def _open(s: Setup, workdir: pathlib.Path, *, allow_config_change: bool, server):
    """The run's logs, checkpoints and live view, and where it starts (resumed or not)."""
    cfg, t = s.cfg, s.cfg.train
    lead = jax.process_index() == 0
    reporting.setup_logging(process=jax.process_index(), processes=jax.process_count())
    mngr = checkpoint.manager(workdir, max_to_keep=t.keep_checkpoints) if t.checkpoint else None
    start = resume.resume(mngr, s, workdir, allow_config_change=allow_config_change)
    s.resume_data(start)
    if lead:
        resume.record(workdir, cfg, start)
    runlog = records.open_runlog(cfg, workdir, start.step, enabled=lead)  # + run_record.jsonl
    live = Live(cfg, s, workdir, lead=lead, controls=start.controls, server=server)
    if live.board is not None:
        if start.step:  # resumed: the charts start with the run's earlier history
            live.board.replay(workdir / "metrics.jsonl", start.step)
        runlog.watch(live.board.event)
    log.info(
        "%s: %d replicas on %s (%d replica x %d data devices, %d processes), %d params, "
        "%d %ss per step", cfg.algorithm, s.layout.replicas, s.layout.runtime,
        s.layout.replica_devices, s.layout.data_devices, jax.process_count(), s.num_params,
        s.layout.replicas * cfg.data.batch_size * s.tokens_per_row, s.unit,
    )  # fmt: skip
    return _Run(lead, mngr, runlog, live), start


def _compile(s: Setup, state, phases: reporting.Phases, material: dict | None = None):
    """The step's executable, compiled or loaded from the persistent cache, memory checked;
    and whether it was loaded. ``material``: :func:`diloco_jax.programs.material`, where the
    step's traced program is kept too."""
    log.info("compiling %d steps per call ...", s.cfg.train.log_every)
    t0, hits = time.time(), compile_cache.hits()
    with phases("compile"):
        args = (state, s.replicas_R, s.shards_RxS, chunk_control(s.cfg, s, 0))
        lowered, traced, path = programs.lower(s, args, material)
        ahead = threading.Thread(target=_compile_ahead, args=(s, state), name="compile-ahead")
        ahead.start()  # traced while XLA compiles the step (or loads it), without the GIL
        try:
            run = lowered.compile()
        except Exception as e:
            if path is None:
                raise
            compile_cache.drop(path, e)  # the exported call did not compile: JAX's own way
            traced, run = "lowered", s.run_chunk.lower(*args).compile()
        ahead.join()
    entropy = f"; validation unigram entropy {s.unigram_nats:.3f} nats" * (s.unigram_nats > 0)
    loaded = compile_cache.hits() > hits
    how = "loaded from the compilation cache" if loaded else "compiled"
    reused = ", its kept traced program reused" * (traced == "loaded")
    log.info("%s in %.1fs%s%s", how, time.time() - t0, reused, entropy)
    placement.check_memory(s, run)
    return run, loaded


def _compile_ahead(s: Setup, state) -> None:
    """The programs the loop calls after the first steps, compiled (or loaded) before them: the
    outer parameters' extraction, the evaluation, the replicas' fingerprints. A failure here is
    left to the call that will raise it where it belongs."""
    try:
        params = s.outer_fn(state)  # compiled too; placed as the evaluation will take them
        s.evaluate.compile_ahead(params)
        distributed.compile_checks(s, state)
    except Exception as e:  # noqa: BLE001 - only time is at stake
        log.debug("compiling ahead stopped: %s: %s", type(e).__name__, e)


def _between_calls(s: Setup, r: _Run, state, step: int, total: int, asked,
                   phases: reporting.Phases):  # fmt: skip
    """The evaluation and the checkpoint due after the call that ended at ``step`` (or asked
    for over HTTP); returns the eval loss, or None when none was due. After the last call the
    final checkpoint is started before the last evaluation, which runs while it is written."""
    t, eval_loss = s.cfg.train, None
    due = _crossed(step, t.log_every, t.checkpoint_every) or "checkpoint" in asked
    if r.mngr is not None and (due or step >= total):
        with phases("checkpoint"):  # written in the background
            checkpoint.save(r.mngr, step, state, config_lib.to_dict(s.cfg), wait=False,
                            controls=r.live.changed, data=s.data_states())  # fmt: skip
    if _crossed(step, t.log_every, t.eval_every) or step >= total or "eval" in asked:
        with phases("eval"):
            eval_loss = _evaluate(s, r.runlog, state, step, total)
    if r.mngr is not None and due:
        r.runlog.write("checkpoint", step)
    return eval_loss


def _close(s: Setup, r: _Run, summary: dict, step: int, call_seconds, host_seconds,
           phases: reporting.Phases) -> None:  # fmt: skip
    """The steady step time, the host's share and the phases into ``summary``, its ``done``
    event written, the logs and the live view closed."""
    steady = call_seconds[1:] or call_seconds  # the first call can include one-off work
    per_call = s.cfg.train.log_every
    summary["step_seconds"] = float(np.median(steady)) / per_call if steady else None
    # the loop's own work between calls (logs, bar, checks); the median skips evals and saves
    summary["host_seconds"] = float(np.median(host_seconds)) if host_seconds else None
    phases.seconds["steps"] = float(sum(call_seconds))
    summary["phases"] = phases.rounded()
    log.info("time: %s", phases.line())
    r.runlog.write(
        "done", step, **{k: v for k, v in summary.items() if k not in ("sample", "params")}
    )
    r.runlog.close()
    r.live.close()


def train(cfg: config_lib.Config, workdir: str | pathlib.Path, *, show_progress: bool = True,
          allow_config_change: bool = False, server=None, task=None, inner=None, outer=None,
          since_start: float = 0.0):  # fmt: skip
    """Trains ``cfg`` into ``workdir`` (resuming from its newest readable checkpoint; keys that
    change the training must match its config unless ``allow_config_change``); returns a
    summary dict (final eval loss, steps, tokens, time, sample, and the final ``state``).

    SIGTERM or SIGINT stops the run at the next call boundary, with a checkpoint if
    ``train.checkpoint`` (``summary["preempted"]``); a second signal exits at once. With
    ``serve.port`` the run serves its status and control (:mod:`diloco_jax.serve`), through
    ``server`` if given (a sweep's). ``task``: a user's ArrayTask or GrainTask (else
    ``task.factory``'s or the built-in task of ``data.corpus``); ``inner``, ``outer``: the
    user's own optax transforms (else the config's). ``since_start``: seconds the
    process spent before this call (the command's imports), in ``summary["phases"]["start"]``."""
    entered, phases = time.perf_counter(), reporting.Phases()
    given = user_optimizers.Given(inner, outer)
    s = build(cfg, task=task, given=given)  # first: it sets the CPU's device count
    cfg = s.cfg  # the user's optimizers recorded in it
    t, workdir = cfg.train, pathlib.Path(workdir)
    if _draws(s):
        figures.start_helper()  # imports matplotlib on another core while this one compiles
    r, start = _open(s, workdir, allow_config_change=allow_config_change, server=server)
    state = start.state
    phases.seconds["start"] = since_start + time.perf_counter() - entered
    user_code = task is not None or given != user_optimizers.NONE
    run, loaded = _compile(s, state, phases, None if user_code else programs.material(cfg))
    total = -(-t.total_steps // t.log_every) * t.log_every
    if total != t.total_steps:
        log.info("running %d steps: train.total_steps rounded up to whole calls", total)
    step = int(state.step)
    if step == 0 and _eval_at_start(cfg, user_task=task is not None or bool(cfg.task.factory)):
        with phases("eval"):
            _evaluate(s, r.runlog, state, 0, total)
    show = show_progress and r.lead and cfg.log.progress_bar  # TQDM_DISABLE: reporting
    bar = reporting.progress_bar(total, initial=step, enabled=show)
    eval_loss, train_start, call_seconds, host_seconds = None, time.time(), [], []
    with Preemption() as stop:
        while step < total and not _agree_to_stop(stop):
            control = chunk_control(cfg, s, step, r.live.outer_scale)
            tick = time.time()
            state, metrics_NxR = run(state, s.replicas_R, s.data(step), control)
            metrics_NxR = jax.device_get(metrics_NxR)
            call_seconds.append(time.time() - tick)
            step += t.log_every
            _report_chunk(s, r.runlog, bar, step, metrics_NxR, call_seconds[-1])
            distributed.check_replicated(s, state, step)
            asked = r.live.agree(r.runlog, stop, step)  # HTTP controls, as every process agrees
            evaluated = _between_calls(s, r, state, step, total, asked, phases)
            eval_loss = eval_loss if evaluated is None else evaluated
            host_seconds.append(time.time() - tick - call_seconds[-1])
        bar.close()
        if stop.requested:
            log.warning("%s: stopping at step %d %s", stop.requested, step, saving(t.checkpoint))
        elif eval_loss is None:  # resumed a run that had already finished
            eval_loss = _evaluate(s, r.runlog, state, step, total)
        with phases("finish"):
            summary = _finish(s, state, step, eval_loss, time.time() - train_start, r.mngr,
                              workdir, preempted=stop.requested,
                              controls=r.live.changed)  # fmt: skip
        summary["step_from_cache"] = loaded
    _close(s, r, summary, step, call_seconds, host_seconds, phases)
    return {**summary, "state": state}


def dry_run(cfg: config_lib.Config) -> int:
    """``--dry_run``: prints the layout and the memory plan, compiled from shapes (nothing is
    allocated); returns 0, or raises ConfigError if the run would not fit."""
    s = build(cfg, abstract=True)
    args = (s.state, s.replicas_R, s.shards_RxS, chunk_control(cfg, s, 0))
    plan = placement.memory_plan(s, s.run_chunk.lower(*args).compile())
    print(f"{cfg.algorithm}: {s.layout}, {s.num_params:,} params\n{plan.table()}")
    placement.check_fits(plan)
    return 0


def _train_flags(parser: cli.ArgumentParser) -> None:
    parser.add_argument("--dry_run", action="store_true",
                        help="print the layout and the memory plan per device (compiled from "
                        "shapes, nothing allocated) and exit: 0 if it fits, 2 if not")  # fmt: skip


def main(argv: list[str] | None = None, *, prog: str = "python -m diloco_jax.train") -> int:
    watch_launcher()  # started by diloco_jax.launch: stop when it dies
    args = cli.parse(sys.argv[1:] if argv is None else argv, prog=prog, distributed=True,
                     resume=True, description=__doc__, extend=_train_flags)  # fmt: skip
    if args is None:
        return 0
    cfg, workdir = args.cfg, args.workdir
    try:
        distributed.initialize(args.cluster)
        placement.split_cpu(cfg)  # before anything starts JAX
        if args.flags.dry_run:
            return dry_run(cfg)
        if jax.process_count() > 1 and not args.workdir_given:
            raise config_lib.ConfigError(
                "a run of several processes needs --workdir (a directory every process can reach)"
            )
        summary = train(cfg, workdir, allow_config_change=args.allow_config_change,
                        since_start=reporting.process_seconds() or 0.0)  # fmt: skip
    except (config_lib.ConfigError, DataError, checkpoint.CheckpointError, MissingExtra) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except distributed.ConsistencyError as e:
        print(f"error: {e}; stopped without saving (resume from the last checkpoint)",
              file=sys.stderr)  # fmt: skip
        return 1
    if jax.process_index() != 0:
        return 0
    if summary["preempted"]:
        print("\n" + stopped(summary["preempted"], summary["steps"], workdir, cfg.train.checkpoint))
        return 0
    print(reporting.final_lines(summary, workdir))
    return 0


if __name__ == "__main__":
    reporting.exit_quickly(main())
