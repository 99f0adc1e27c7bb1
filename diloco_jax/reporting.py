"""What a run tells its user: ``metrics.jsonl``, TensorBoard events, log lines, a progress bar.

Every event is one JSON object per line in ``metrics.jsonl`` (``{"event": "eval", "step": 250,
"eval_loss": 1.93, ...}``); numeric values also go to TensorBoard as ``<event>/<name>``. Only the
process with index 0 writes anything.
"""

from __future__ import annotations

import json
import logging
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
    """Appends events to ``workdir/metrics.jsonl`` and ``workdir/tensorboard/``."""

    def __init__(self, workdir: pathlib.Path, *, enabled: bool = True):
        self.enabled = enabled
        self._start = time.time()
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(workdir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self._tb = SummaryWriter(str(workdir / "tensorboard"))

    def write(self, event: str, step: int, **values: Any) -> None:
        if not self.enabled:
            return
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
