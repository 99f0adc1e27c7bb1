"""Figures a run draws of itself, with matplotlib (the ``plots`` extra, imported only when a
figure is drawn): the sync diagnostics, drift and cosine against outer steps
(:mod:`diloco_jax.watch.drawing`). The simulator's own figures (``sim/plots.py``) draw with
:func:`pyplot`; a run's are drawn by a helper process (:func:`start_helper`), or in a thread."""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import subprocess
import sys
import threading

from diloco_jax.base import extras
from diloco_jax.watch import drawing
from diloco_jax.watch.drawing import DIAGNOSTICS, sync_events
from diloco_jax.watch.reporting import log

__all__ = ["DIAGNOSTICS", "diagnostics", "draw_in_background", "pyplot", "run_diagnostics",
           "start_helper", "sync_events"]  # fmt: skip


def pyplot():
    """matplotlib's pyplot, drawing into files only (no display needed)."""
    matplotlib = extras.require("matplotlib", "drawing figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def diagnostics(runs: dict[str, list[dict]], directory: pathlib.Path, *,
                per_replica: bool) -> list[str]:  # fmt: skip
    """:func:`diloco_jax.watch.drawing.diagnostics`, with one line naming the extra if a run synced
    and matplotlib is not installed."""
    if any(runs.values()):
        extras.require("matplotlib", "drawing figures")
    return drawing.diagnostics(runs, directory, per_replica=per_replica)


def run_diagnostics(workdir: pathlib.Path) -> list[str]:
    """A finished run's ``drift.png`` and ``cosine.png`` (a line per replica) in ``workdir``, if
    matplotlib is installed and the run synced; the files written. Never raises: a figure that
    cannot be drawn is a warning, not a failed run."""
    if extras.missing("matplotlib"):
        _not_drawn(f"matplotlib is not installed ({extras.install_hint('matplotlib')}; "
                   "or log.figures=false to skip them)")  # fmt: skip
        return []
    try:
        return drawing.run_figures(workdir)
    except Exception as e:  # noqa: BLE001 - the run's results are saved; only a figure is lost
        _not_drawn(f"{type(e).__name__}: {e}")
        return []


def _not_drawn(why: str) -> None:
    log.warning("drift.png and cosine.png not drawn: %s", why)


class _Helper:
    """``python diloco_jax/watch/drawing.py`` in a process of its own, asked for a run's figures
    over its standard input, one request at a time."""

    def __init__(self):
        # -P: the script's directory (this package's) stays off sys.path, so none of its
        # modules' names can shadow one of matplotlib's imports
        self.process: subprocess.Popen[str] = subprocess.Popen(
            [sys.executable, "-P", drawing.__file__], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "MPLBACKEND": "Agg"},
        )  # fmt: skip
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.process.poll() is None

    def draw(self, workdir: pathlib.Path) -> list[str] | None:
        """The files drawn ([] with a warning if drawing failed), or None if the helper is
        gone."""
        with self.lock:
            stdin, stdout = self.process.stdin, self.process.stdout
            assert stdin is not None and stdout is not None  # both are pipes
            try:
                stdin.write(json.dumps({"workdir": str(workdir.resolve())}) + "\n")
                stdin.flush()
                line = stdout.readline()
            except (OSError, ValueError):  # a broken pipe, or closed
                return None
        try:
            reply = json.loads(line)
        except ValueError:  # gone (""), or out of step with its requests: not asked again
            self.process.kill()
            return None
        if "error" in reply:
            _not_drawn(reply["error"])
            return []
        return reply["files"]

    def stop(self) -> None:
        """Closes its input: it exits then, on its own (not waited for: its interpreter's
        teardown would add 0.2 s to the command's end)."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
        except OSError:
            pass


_helper: _Helper | None = None
_helper_lock = threading.Lock()


def start_helper() -> _Helper | None:
    """The process that draws runs' figures, started if none runs (and matplotlib is
    installed); None if it cannot start. A run calls it as it starts, so that the helper's
    imports (0.6 s of matplotlib) take the time the run spends building and compiling on one
    core; runs in one process (a sweep's) share it. Closed at exit."""
    global _helper
    with _helper_lock:
        if _helper is not None and _helper.alive():
            return _helper
        if extras.missing("matplotlib"):
            return None
        try:
            _helper = _Helper()
        except OSError as e:
            log.info("figures drawn in this process: the helper did not start (%s)", e)
            return None
        atexit.register(_helper.stop)
        return _helper


def draw_in_background(workdir: pathlib.Path) -> threading.Thread:
    """:func:`run_diagnostics`, started: by the helper process (:func:`start_helper`), or in
    this process if it is gone, while the run writes its last outputs (its final checkpoint,
    its exported params); ``join()`` the thread returned before the run returns."""

    def draw():
        helper = start_helper()
        if helper is None or helper.draw(workdir) is None:
            run_diagnostics(workdir)

    thread = threading.Thread(target=draw, name="figures")
    thread.start()
    return thread
