"""What a run tells its user: ``metrics.jsonl``, TensorBoard events, log lines, a progress bar.

Every event is one JSON object per line in ``metrics.jsonl`` (``{"event": "eval", "step": 250,
"eval_loss": 1.93, ...}``); numeric values also go to TensorBoard as ``<event>/<name>``, a
per-replica list as one series per replica, ``<event>/<name>/replica_<r>`` (:func:`scalars`), and
to the optional sinks (:class:`WandbWriter`). Only the process with index 0 writes anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any

import numpy as np
import tqdm

log = logging.getLogger("diloco_jax")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # diloco_jax/


class _TqdmHandler(logging.Handler):
    """Log lines that do not tear the progress bar."""

    def emit(self, record):
        tqdm.tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(level: int | None = None, *, process: int = 0, processes: int = 1,
                  party: str = "") -> None:  # fmt: skip
    """Log lines to stderr (once). ``level`` None keeps a level set earlier (default INFO). In a
    run of several ``processes``, the others than process 0 log warnings and errors only, with
    a ``[process i]`` prefix; ``party`` (``learner 1``, ``syncer``) prefixes every line, where
    several parties share a terminal (``[learner 1]``, ``[learner 1, process 2]``)."""
    if not log.handlers:
        log.addHandler(_TqdmHandler())
        log.propagate = False
    names = [name for name in (party, f"process {process}" if processes > 1 else "") if name]
    prefix = f"[{', '.join(names)}] " if names else ""
    for handler in log.handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
    if process != 0:
        log.setLevel(logging.ERROR)
    elif level is not None:
        log.setLevel(level)
    elif log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


class RunLog:
    """Appends events to ``workdir/metrics.jsonl`` and ``workdir/tensorboard/``.

    The file holds each ``(event, step)`` once. A run that starts at ``start_step`` (a resumed
    checkpoint's step, 0 from scratch) first drops the events past it, which an attempt whose
    state was not saved wrote and which this run writes again (TensorBoard hides them too:
    ``purge_step``); an ``(event, step)`` already in the file is not written again (a finished
    run that is resumed evaluates again at the same step)."""

    def __init__(self, workdir: pathlib.Path, *, enabled: bool = True, start_step: int = 0,
                 hparams: dict[str, Any] | None = None, sinks: tuple = ()):  # fmt: skip
        """``hparams`` (flat, scalar values: the resolved config) go to TensorBoard's HParams
        tab once, when the workdir's ``tensorboard/`` is created; ``sinks`` (objects with
        ``write(step, scalars)`` and ``close()``) get every new event's :func:`scalars`."""
        self.enabled = enabled
        self._start = time.time()
        self._sinks = sinks
        self._watchers: list = []
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "metrics.jsonl"
        self._written = _keep_until(path, start_step)
        self._jsonl = open(path, "a", buffering=1)  # noqa: SIM115
        tensorboard = workdir / "tensorboard"
        purge = start_step + 1 if tensorboard.exists() else None
        self._tb = SummaryWriter(str(tensorboard), purge_step=purge)
        if hparams and purge is None:  # a resume keeps the first start's
            _write_hparams(self._tb, hparams)

    def write(self, event: str, step: int, **values: Any) -> None:
        if not self.enabled or (event, int(step)) in self._written:
            return
        self._written.add((event, int(step)))
        now = time.time()
        record = {
            "event": event,
            "step": int(step),
            "time_s": round(now - self._start, 3),
            "time": round(now, 3),
        }  # Unix time, as the syncer's tape: logs line up
        record.update({k: _plain(v) for k, v in values.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        series = scalars(record)
        if series:  # one TensorBoard event for all of them (one each: 0.2 ms per number)
            self._tb.file_writer.add_summary(_summary(series), int(step))
        for sink in self._sinks:
            sink.write(int(step), series)
        for watcher in self._watchers:
            watcher(record)

    def watch(self, fn) -> None:
        """``fn(record)`` for every new event from now on (the record as ``metrics.jsonl``
        holds it: plain JSON values)."""
        self._watchers.append(fn)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
        for sink in self._sinks:
            sink.close()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """An event's numbers by TensorBoard tag: ``<event>/<name>`` for a number (a bool as 0 or
    1), ``<event>/<name>/replica_<r>`` for each entry of a list of numbers (per-replica loss,
    drift, finiteness); strings, None and nested lists are left out."""
    event, out = record["event"], {}
    for name, value in record.items():
        if name in ("event", "step", "time"):
            continue
        if isinstance(value, int | float):
            out[f"{event}/{name}"] = float(value)
        elif isinstance(value, list) and all(isinstance(v, int | float) for v in value):
            out.update({f"{event}/{name}/replica_{r}": float(v) for r, v in enumerate(value)})
    return out


# What every record holds besides measurements: what RunLog.write adds (the event, its step,
# seconds since the run started, the Unix time) and where training stood (outer steps, tokens).
# Never a metric: the sweep tables' final_* columns, the dashboard and /metrics leave them out.
BOOKKEEPING = ("event", "step", "time_s", "time", "outer_steps", "tokens")


def eval_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numbers an ``eval`` record holds besides its loss and the :data:`BOOKKEEPING`: what
    the task's evaluation returned (``accuracy``, ...)."""
    return {k: v for k, v in record.items()
            if k not in (*BOOKKEEPING, "eval_loss") and isinstance(v, int | float)}  # fmt: skip


def _summary(series: dict[str, float]):
    """A TensorBoard summary of the scalars ``series`` (``{tag: value}``), as ``add_scalar``
    writes each."""
    from tensorboardX.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in series.items()])


HPARAM_METRICS = ("eval/eval_loss", "train/loss")  # the HParams tab's columns


def _write_hparams(writer, hparams: dict[str, Any]) -> None:
    """The HParams tab's experiment and session start, in this run's own events (tensorboardX's
    ``add_hparams`` would make a sub-run)."""
    from tensorboardX.summary import hparams as hparams_summary

    experiment, start, _ = hparams_summary(hparams, dict.fromkeys(HPARAM_METRICS, 0.0))
    writer.file_writer.add_summary(experiment)
    writer.file_writer.add_summary(start)


class WandbWriter:
    """A Weights & Biases run in ``workdir/wandb`` that gets each event's :func:`scalars` at its
    step; ``config`` becomes the run's config. ``mode="offline"`` writes files only (upload
    them later with ``wandb sync``). A resumed run starts a new W&B run in the same group."""

    def __init__(self, workdir: pathlib.Path, *, project: str, mode: str, config: dict):
        from diloco_jax.base import extras

        wandb = extras.require("wandb", "Weights & Biases logging")
        workdir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, mode=mode, dir=str(workdir), config=config,
                              group=workdir.resolve().name)  # fmt: skip

    def write(self, step: int, series: dict[str, float]) -> None:
        self.run.log(series, step=step)

    def close(self) -> None:
        self.run.finish()


def _keep_until(path: pathlib.Path, start_step: int) -> set[tuple[str, int]]:
    """Rewrites the events file at ``path`` without the events past ``start_step``, repeated
    ones and a line torn by a kill; returns the ``(event, step)`` pairs it keeps."""
    if not path.exists():
        return set()
    kept, seen = [], set()
    text = path.read_text()
    lines = text.splitlines()
    for line in lines:
        try:
            record = json.loads(line)
            key = (record["event"], int(record["step"]))
        except (ValueError, KeyError, TypeError):
            continue
        if key[1] <= start_step and key not in seen:
            kept.append(line)
            seen.add(key)
    if len(kept) < len(lines) or text[-1:] not in ("", "\n"):  # a kill can cut the newline
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(line + "\n" for line in kept))
        os.replace(partial, path)  # atomic: a kill now leaves the old file or the new one
    if len(kept) < len(lines):
        log.warning("%s: dropped %d lines past step %d (from an attempt whose state was not "
                    "saved; this run writes its own), repeated or torn", path,
                    len(lines) - len(kept), start_step)  # fmt: skip
    return seen


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def log_syncs(runlog: RunLog, plan, first_step: int, metrics_NxR: dict) -> None:
    """One ``sync`` event per DiLoCo sync started in a call of steps ``first_step + 1 ...``
    (``plan``, a ``SyncPlan``, says which steps): per-replica drift diagnostics and the shared
    statistics; a warning for replicas whose pseudo-gradient was not finite."""
    shared = ("pairwise_cosine", "outer_update_norm", "contributors")
    for step, fragment in plan.sync_steps(first_step + 1, first_step + len(metrics_NxR["loss"])):
        i = step - first_step - 1
        values = {k: v[i] for k, v in metrics_NxR.items() if k not in (*shared, "aux")}
        values.update({k: float(metrics_NxR[k][i, 0]) for k in shared})
        if np.isnan(
            values["pairwise_cosine"]
        ):  # not computed (sim.diagnostics off, or several processes)
            del values["pairwise_cosine"]
        outer = plan.rounds(step)
        if plan.fragments > 1:
            values["fragment"] = fragment
        runlog.write("sync", step, outer_step=outer, **values)
        bad = [r for r, ok in enumerate(values["finite"]) if not ok]
        if bad and len(bad) == len(values["finite"]):
            log.warning("outer step %d discarded: every replica's pseudo-gradient is non-finite; "
                        "all restart from the anchor", outer)  # fmt: skip
        elif bad:
            log.warning("outer step %d: replica(s) %s had non-finite pseudo-gradients: left out "
                        "of the mean, restarted from the anchor", outer, bad)  # fmt: skip


def process_seconds() -> float | None:
    """Seconds since this process started (Linux's ``/proc``; None elsewhere): the command's
    start-up before the training loop, imports included."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def only_installed_code(modules=None) -> bool:
    """Whether every module loaded (``sys.modules``) comes from Python's installation, its
    environment or this package: no user task, example or test module ran in this process."""
    roots = {os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                    _PACKAGE)}  # fmt: skip
    for module in list((sys.modules if modules is None else modules).values()):
        file = getattr(module, "__file__", None)
        if file and not any(os.path.realpath(file).startswith(r) for r in roots):
            return False
    return True


def exit_quickly(code: int) -> None:
    """Ends the command with ``code``, skipping the interpreter's teardown of its thousands of
    modules (0.2-0.4 s after every run here, most of it flax's and jax's) when
    :func:`only_installed_code` ran (a user's module may keep an open file that the teardown
    would flush; then it is the usual ``sys.exit``). What the teardown does that matters is
    done first: the other threads are joined, the ``atexit`` handlers run (jax.distributed's
    shutdown among them), logging and the standard streams are flushed. (Not a garbage
    collection: 0.14 s, and this package's code closes what it opens.)"""
    if not only_installed_code():
        sys.exit(code)
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


class Phases:
    """Where a run's time went: ``start`` (to the training loop: imports, data, state; from the
    process's start for the command, from ``train()``'s call for ``fit``), ``compile``,
    ``steps`` (the compiled calls), ``eval``, ``checkpoint`` (the saves' blocking part, and the
    wait for the last one's writing) and ``finish`` (exported parameters, figures, sample). ``with
    phases("eval"): ...`` adds that block's seconds."""

    NAMES = ("start", "compile", "steps", "eval", "checkpoint", "finish")

    def __init__(self):
        self.seconds = dict.fromkeys(self.NAMES, 0.0)

    @contextlib.contextmanager
    def __call__(self, name: str):
        tick = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - tick

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in self.seconds.items()}

    def line(self) -> str:
        return ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items())


def final_lines(summary: dict, workdir) -> str:
    """What ``train`` prints at the end of a run: the final eval loss (in nats for the built-in
    tasks, as it is for a user's), steps, tokens (or examples), time, where the outputs are, and
    the text sample if there is one."""
    unit = summary["unit"]
    nats = f" nats/{unit}" if summary["unigram_entropy"] is not None else ""
    text = (f"\nfinal eval loss {summary['final_eval_loss']:.4f}{nats} after "
            f"{summary['steps']} inner / {summary['outer_steps']} outer steps "
            f"({summary['tokens']:,} {unit}s, {summary['train_seconds']:.0f}s); "
            f"outputs in {workdir}")  # fmt: skip
    if "sample" in summary:
        text += "\n\n--- sample from the outer parameters ---\n" + summary["sample"]
    return text
