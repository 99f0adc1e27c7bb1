"""What a run tells its user: ``metrics.jsonl``, TensorBoard events, log lines, a progress bar.

Every event is one JSON object per line in ``metrics.jsonl`` (``{"event": "eval", "step": 250,
"eval_loss": 1.93, ...}``); numeric values also go to TensorBoard as ``<event>/<name>``. Only the
process with index 0 writes anything.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys
import time
from typing import Any

import tqdm

log = logging.getLogger("diloco_jax")


class _TqdmHandler(logging.Handler):
    """Log lines that do not tear the progress bar."""

    def emit(self, record):
        tqdm.tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(level: int | None = None, *, process: int = 0, processes: int = 1) -> None:
    """Log lines to stderr (once). ``level`` None keeps a level set earlier (default INFO). In a
    run of several ``processes``, the others than process 0 log warnings and errors only, with
    a ``[process i]`` prefix."""
    if not log.handlers:
        log.addHandler(_TqdmHandler())
        log.propagate = False
    prefix = f"[process {process}] " if processes > 1 else ""
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

    def __init__(self, workdir: pathlib.Path, *, enabled: bool = True, start_step: int = 0):
        self.enabled = enabled
        self._start = time.time()
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

    def write(self, event: str, step: int, **values: Any) -> None:
        if not self.enabled or (event, int(step)) in self._written:
            return
        self._written.add((event, int(step)))
        record = {"event": event, "step": int(step), "time_s": round(time.time() - self._start, 3)}
        record.update({k: _plain(v) for k, v in values.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        for name, value in record.items():
            if name not in ("event", "step") and isinstance(value, int | float):
                self._tb.add_scalar(f"{event}/{name}", value, int(step))

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


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


def progress_bar(
    total: int, *, initial: int = 0, enabled: bool = True, unit: str = "step", desc: str = ""
) -> tqdm.tqdm:
    return tqdm.tqdm(
        total=total,
        desc=desc or None,
        initial=initial,
        unit=unit,
        dynamic_ncols=True,
        disable=not enabled,
        mininterval=0.5,
        file=sys.stderr,
    )
