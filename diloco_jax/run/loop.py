"""The training loop's steps, named as ``diloco_jax.train.train`` tells them: the run's logs,
checkpoints and live view opened (resumed or not), the step compiled (or loaded), the calls of
steps with what is due between them (reports, evaluation, checkpoint, HTTP controls, the
agreement to stop), and the run's end (final checkpoint, figures, summary, ``done`` event)."""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.base.progress import progress_bar
from diloco_jax.learners import learner as learners
from diloco_jax.learners import service
from diloco_jax.run import distributed, placement, programs, resume
from diloco_jax.run.live import Live
from diloco_jax.run.preemption import Preemption, saving
from diloco_jax.run.setup import Setup, chunk_control
from diloco_jax.runtime import checkpoint, compile_cache, parallel
from diloco_jax.tasks.sample import generate_text
from diloco_jax.watch import figures, records, reporting
from diloco_jax.watch.reporting import log


def outer_steps(cfg: config_lib.Config, step: int) -> int:
    """Syncs completed after ``step`` inner steps (ddp syncs every step, single never)."""
    return {"diloco": step // cfg.outer.sync_every, "ddp": step, "single": 0}[cfg.algorithm]


def finish(s: Setup, calls: Calls, mngr, workdir, preempted, controls: dict,
           phases: reporting.Phases):  # fmt: skip
    """Final checkpoint, figures, outer params and text sample, the first two written in the
    background while the others are made; returns the run's summary (``preempted``: the name
    of the signal that stopped the run, or None; ``controls``: what was changed over HTTP,
    saved with the checkpoint). The checkpoint's blocking part and the wait for its writing
    count as ``checkpoint`` in ``phases``, the rest as ``finish``."""
    state, step = calls.state, calls.step
    with phases("finish"):
        drawing = figures.draw_in_background(workdir) if draws(s) else None
    if mngr is not None and mngr.latest_step() != step:  # written while the rest is made
        with phases("checkpoint"):
            checkpoint.save(mngr, step, state, config_lib.to_dict(s.cfg), controls=controls,
                            data=s.data_states(), wait=False)  # fmt: skip
    try:
        with phases("finish"):
            return _outputs(s, calls, workdir, preempted)
    finally:
        with phases("finish"):
            if drawing is not None:
                drawing.join()
        if mngr is not None:
            with phases("checkpoint"):
                mngr.wait_until_finished()
            log.info("checkpoint saved: %s", workdir / "checkpoints" / str(step))


def draws(s: Setup) -> bool:
    """Whether this process draws the run's drift.png and cosine.png (matplotlib)."""
    return jax.process_index() == 0 and s.cfg.log.figures


def _outputs(s: Setup, calls: Calls, workdir, preempted):
    """The summary, the exported outer params and the text sample."""
    cfg, state, step = s.cfg, calls.state, calls.step
    summary = {
        "final_eval_loss": calls.eval_loss,
        "eval_step": calls.eval_step,  # the step of that evaluation (before a stop, an earlier)
        "steps": step,
        "outer_steps": outer_steps(cfg, step),
        "tokens": step * s.layout.replicas * cfg.data.batch_size * s.tokens_per_row,
        "unit": s.unit,  # what "tokens" counts
        "train_seconds": round(calls.seconds, 2),
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


def _at_sync(cfg: config_lib.Config, step: int) -> bool:
    """Whether ``step`` ends a DiLoCo round (every step of the baselines does): where a
    checkpoint may be taken."""
    return cfg.algorithm != "diloco" or step % cfg.outer.sync_every == 0


def _crossed(step: int, chunk: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``(step - chunk, step]``."""
    return every > 0 and step // every > (step - chunk) // every


def _report_chunk(s: Setup, runlog, bar, step: int, metrics_NxR, seconds: float,
                  learner=None) -> None:  # fmt: skip
    cfg, n = s.cfg, s.cfg.train.log_every
    if learner is not None:  # its syncs are the syncer's rounds
        if learner.last and learner.due(step):
            runlog.write("round", step, **learner.last)
    elif cfg.algorithm == "diloco":
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


def evaluate(s: Setup, runlog, state, step: int, total: int) -> float:
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


def eval_at_start(cfg: config_lib.Config, *, user_task: bool) -> bool:
    """``train.eval_at_start``: ``auto`` evaluates a user's task at step 0 (its curves then
    start at the initial loss); the built-in tasks' runs keep their first evaluation at
    ``train.eval_every``."""
    return cfg.train.eval_at_start == "true" or (cfg.train.eval_at_start == "auto" and user_task)


def stop_plan(cfg: config_lib.Config) -> str:
    """What a run does on SIGTERM or SIGINT, as its acknowledgement says it at once."""
    if cfg.syncer.address:
        return "this learner stops at its next sync, saving once its round is merged"
    then = saving(cfg.train.checkpoint)
    return f"stopping at the next call boundary (every {cfg.train.log_every} steps) {then}"


def agree_to_stop(stop: Preemption) -> bool:
    """Whether any process got SIGTERM/SIGINT; every process asks after the same call, so all
    stop at the same step (one tiny all-gather per call when there are several processes)."""
    signalled = distributed.any_process(stop.requested is not None)
    if signalled and stop.requested is None:
        stop.requested = f"a signal to process {signalled[0]}"
    return bool(signalled)


class SaveClock:
    """When a checkpoint is due by time (``train.checkpoint_minutes``): the first soon after
    training starts (:data:`FIRST` of the interval after :meth:`started`), each later one twice
    as long after the one before it, up to the interval (a run killed early loses at most about
    as much as it had trained before its newest save, never minutes of it); each stretched where
    saving blocks the loop for long, so that the blocking part of saving stays within
    :data:`MAX_SHARE` of the time between saves."""

    MAX_SHARE = 0.02
    FIRST = 1 / 8  # 15 s of the default 2 minutes

    def __init__(self, minutes: float, now: Callable[[], float] = time.monotonic):
        self.every, self.now = 60.0 * minutes, now
        self.started()

    def started(self) -> None:
        """Training starts now (after the compile): the ramp from :data:`FIRST` begins."""
        self.base = self.interval = self.every * self.FIRST
        self.last = self.now()

    def due(self) -> bool:
        return self.every > 0 and self.now() - self.last >= self.interval

    def saved(self, blocked_s: float) -> None:
        """A save that held the loop ``blocked_s`` seconds has just been started."""
        self.last = self.now()
        self.base = min(self.every, 2 * self.base)
        stretched = max(self.base, blocked_s / self.MAX_SHARE)
        if stretched > self.base and stretched > self.interval:
            log.info("a save blocked the loop %.1fs: saving every %.1f min or less often",
                     blocked_s, stretched / 60)  # fmt: skip
        self.interval = stretched


class Run(NamedTuple):
    """What a run writes to and is watched through."""

    lead: bool  # the process that logs and writes files
    mngr: Any  # the checkpoint manager, or None (train.checkpoint=false)
    runlog: reporting.RunLog
    live: Live
    learner: Any  # syncer.address: this run's side of the syncer's rounds, else None
    clock: SaveClock  # when a save is due by time


def open_run(s: Setup, workdir: pathlib.Path, *, allow_config_change: bool, server):
    """The run's logs, checkpoints and live view, and where it starts (resumed or not)."""
    cfg, t = s.cfg, s.cfg.train
    lead = jax.process_index() == 0
    party = f"learner {cfg.syncer.learner}" if cfg.syncer.address else ""  # prefixes its lines
    reporting.setup_logging(process=jax.process_index(), processes=jax.process_count(), party=party)
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
    learner = None
    if cfg.syncer.address:  # a learner: it starts from the syncer's anchor (refused before
        # the compile if it would be; a synchronous round waits for it while it compiles)
        fsdp_specs = parallel.state_specs(start.state, s.algorithm.kinds, s.layout)
        learner = learners.connect(cfg, s.algorithm, config_lib.keys(cfg), log, mesh=s.mesh,
                                   replicas=s.layout.replicas, fsdp_specs=fsdp_specs)  # fmt: skip
        start = start._replace(state=learner.join(start.state))
    return Run(lead, mngr, runlog, live, learner, SaveClock(t.checkpoint_minutes)), start


def compile_step(s: Setup, state, phases: reporting.Phases, material: dict | None = None):
    """The step's executable, compiled or loaded from the persistent cache, memory checked;
    and whether it was loaded. ``material``: :func:`diloco_jax.run.programs.material`, where the
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


def _between_calls(s: Setup, r: Run, state, step: int, total: int, asked,
                   phases: reporting.Phases):  # fmt: skip
    """The evaluation and the checkpoint due after the call that ended at ``step`` (or asked
    for over HTTP); returns the eval loss, or None when none was due. After the last call the
    final checkpoint is started before the last evaluation, which runs while it is written."""
    t, eval_loss = s.cfg.train, None
    due = _crossed(step, t.log_every, t.checkpoint_every) or "checkpoint" in asked
    if r.mngr is not None and not due and step < total and _at_sync(s.cfg, step):
        due = r.clock.every > 0 and bool(distributed.from_lead([int(r.clock.due())])[0])
    if r.mngr is not None and (due or step >= total):
        with phases("checkpoint"):  # written in the background
            blocked = time.perf_counter()
            checkpoint.save(r.mngr, step, state, config_lib.to_dict(s.cfg), wait=False,
                            controls=r.live.changed, data=s.data_states())  # fmt: skip
            r.clock.saved(time.perf_counter() - blocked)
    if _crossed(step, t.log_every, t.eval_every) or step >= total or "eval" in asked:
        with phases("eval"):
            eval_loss = evaluate(s, r.runlog, state, step, total)
    if r.mngr is not None and due:
        r.runlog.write("checkpoint", step)
    return eval_loss


def close(s: Setup, r: Run, summary: dict, step: int, call_seconds, host_seconds,
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
    if r.learner is not None:
        r.learner.close()
    if r.mngr is not None:  # its writer threads end now, not when a garbage collection finds
        r.mngr.close()  # it (a caught network error's frames can hold the run that long)


class Calls(NamedTuple):
    """What the loop of calls ended with."""

    state: object
    step: int
    eval_loss: float | None  # the last evaluation's, None where none ran
    eval_step: int | None  # the step of the last evaluation
    seconds: float  # from the first call to the last's end
    call_seconds: list  # each call's time on the devices
    host_seconds: list  # the loop's own time after each call


def _syncer_done(r: Run) -> bool:
    """A learner whose syncer has closed the run's last round (``syncer.rounds`` or
    ``syncer.examples``)."""
    return r.learner is not None and r.learner.finished


def _learner_turn(s: Setup, r: Run, state, step: int, total: int, stop: Preemption):
    """``(state, whether it synced)`` after a learner's call that ended at ``step``: the landing
    due, then the sync due, the last where the run ends or every process agrees to stop (at a
    sync, never mid-round: its round's work is in the anchor and its checkpoint, and a resume
    trains nothing twice). A syncer it cannot reach is raised once ``state`` is saved at
    ``step``: its steps, data and inner state are kept, not its work since its last sync."""
    learner = r.learner
    try:
        if learner.landing(step):  # streaming's overlap tau
            state = learner.land(state)
        if not learner.due(step):
            return state, False
        last = step >= total or agree_to_stop(stop)
        if stop.requested:  # a signal to another process of this learner
            learner.stopping()
        return learner.sync(state, last=last), True
    except service.SyncerUnreachable:
        if r.mngr is not None and r.mngr.latest_step() != step:
            checkpoint.save(r.mngr, step, state, config_lib.to_dict(s.cfg),
                            controls=r.live.changed, data=s.data_states())  # fmt: skip
            r.runlog.write("checkpoint", step)
            log.warning("the syncer cannot be reached: this learner saved its state at step %d "
                        "before giving up (its work since its last sync is not in the anchor)",
                        step)  # fmt: skip
        raise


def run_calls(s: Setup, r: Run, run, state, total: int, stop: Preemption,
              phases: reporting.Phases, *, show_progress: bool) -> Calls:  # fmt: skip
    """Calls the compiled step (``train.log_every`` steps a call) until ``total`` steps or a
    stop that every process agrees on (a learner's at its next sync: :func:`_learner_turn`);
    after each call the reports, the replication check, the HTTP controls, and the evaluation
    and checkpoint that are due."""
    cfg, step = s.cfg, int(state.step)
    show = show_progress and r.lead and cfg.log.progress_bar  # TQDM_DISABLE: progress_bar
    bar = progress_bar(total, initial=step, enabled=show)
    eval_loss, train_start, call_seconds, host_seconds = None, time.time(), [], []
    evaluated_at = None
    between = True  # where the run may stop: any call's end; a learner's join or sync only
    if r.learner is not None:
        stop.hooks.append(r.learner.stopping)
    r.clock.started()
    while step < total and not _syncer_done(r) and not (between and agree_to_stop(stop)):
        control = chunk_control(cfg, s, step, r.live.outer_scale)
        tick = time.time()
        state, metrics_NxR = run(state, s.replicas_R, s.data(step), control)
        metrics_NxR = jax.device_get(metrics_NxR)
        call_seconds.append(time.time() - tick)
        step += cfg.train.log_every
        between = r.learner is None
        if r.learner is not None:  # push, wait, restart
            r.learner.observe(metrics_NxR["loss"])  # the round's mean loss goes with its push
            state, between = _learner_turn(s, r, state, step, total, stop)
        _report_chunk(s, r.runlog, bar, step, metrics_NxR, call_seconds[-1], r.learner)
        distributed.check_replicated(s, state, step)
        asked = r.live.agree(r.runlog, stop, step)  # HTTP controls, as every process agrees
        evaluated = _between_calls(s, r, state, step, total, asked, phases)
        if evaluated is not None:
            eval_loss, evaluated_at = evaluated, step
        host_seconds.append(time.time() - tick - call_seconds[-1])
    bar.close()
    if stop.requested:
        log.warning("%s: stopping at step %d %s", stop.requested, step,
                    saving(cfg.train.checkpoint))  # fmt: skip
    elif eval_loss is None or (_syncer_done(r) and evaluated_at != step):
        # a finished run resumed, or the syncer's last round closed between evaluations
        eval_loss, evaluated_at = evaluate(s, r.runlog, state, step, total), step
    return Calls(state, step, eval_loss, evaluated_at, time.time() - train_start, call_seconds,
                 host_seconds)  # fmt: skip


def total_steps(cfg: config_lib.Config) -> int:
    """``train.total_steps`` rounded up to whole calls of ``train.log_every`` steps."""
    t = cfg.train
    total = -(-t.total_steps // t.log_every) * t.log_every
    if total != t.total_steps:
        log.info("running %d steps: train.total_steps rounded up to whole calls", total)
    return total
