"""Graceful preemption: SIGTERM or SIGINT asks the training loop to stop at the next call
boundary, where it saves a checkpoint (unless ``train.checkpoint`` is off) and returns; a second
signal exits at once. A learner (``syncer.address``) stops at its next sync instead, so that its
round's work is in the syncer's anchor and in its own checkpoint
(:func:`~diloco_jax.run.loop.run_calls`).

The processes that ``diloco_jax.launch`` starts are tied to it, so that they stop when it dies,
however it dies (SIGKILL, the out-of-memory killer, a closed terminal): the launcher hands each
one :func:`launcher_tie`; the process calls :func:`watch_launcher` when it starts.

- On Linux the kernel sends the process SIGTERM when the launcher dies (the parent-death signal,
  ``prctl(PR_SET_PDEATHSIG)``, set between fork and exec, so it holds from the first instruction).
- Everywhere, a thread of the process polls ``os.getppid()``; when the launcher is gone it sends
  SIGTERM to its own process where the kernel did not, then waits the launcher's ``--grace`` and
  kills the process if it is still running: nobody else is left to stop one that hangs.

SIGTERM takes the graceful path above: the processes agree on a step, save and exit.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)
LAUNCHER_ENV = "DILOCO_LAUNCHER"  # "PID GRACE", set by the launcher in each process it starts
_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2  # <linux/prctl.h>


class _Count:
    """Signals counted as a person sends them: the first one again within :data:`ECHO` seconds
    is the same one delivered twice (``uv run`` forwards a SIGTERM that a kill of the process
    group, ``timeout``'s say, also sends its child), not a second. :meth:`add` returns the
    count, 0 for such an echo."""

    ECHO = 1.0

    def __init__(self):
        self.count, self.first, self.at = 0, None, 0.0

    def add(self, signum: int) -> int:
        now = time.monotonic()
        if self.count == 1 and signum == self.first and now - self.at < self.ECHO:
            return 0
        self.count += 1
        if self.count == 1:
            self.first, self.at = signum, now
        return self.count


class Preemption:
    """Context manager; ``requested`` holds the first signal's name once one arrived, and each
    of ``hooks`` is called then (in the signal handler, so it only sets a flag or a number: a
    learner's shorter patience for a syncer it cannot reach, say).

    Python runs a signal's handler in the main thread between two bytecodes, which can be many
    seconds away while that thread is in a compiled step, a compile or a save. So a thread,
    woken through :func:`signal.set_wakeup_fd` as the signal arrives, says at once what will
    happen (``plan``: "stopping at the next call boundary, with a checkpoint", say), and exits
    the process at once on a second signal, saying what is lost."""

    def __init__(self, plan: str = "stopping at the next call boundary", *, out=None):
        self.requested: str | None = None
        self.hooks: list[Callable[[], None]] = []
        self.plan, self._out = plan, out
        self._signals = _Count()  # as Python's handler sees them (the thread keeps its own)
        self._exiting = threading.Lock()  # one says the second signal's line, and exits
        self._previous: dict = {}
        self._wakeup: tuple | None = None  # (previous wakeup fd, our two sockets, the thread)

    def _handle(self, signum, frame):
        del frame
        count = self._signals.add(signum)
        if count == 0:  # the first one delivered again
            return
        if count > 1:  # second signal: at once, like an unhandled one
            self._stop_now(signum)
        self.requested = self.requested or signal.Signals(signum).name
        for hook in self.hooks:
            hook()

    def _say(self, line: str) -> None:
        try:
            print(line, file=self._out or sys.stderr, flush=True)
        except (OSError, ValueError, RuntimeError):  # a closed stream, or one mid-write in the
            pass  # main thread that a handler interrupted: the stop goes on

    def _stop_now(self, signum: int) -> None:
        """Ends the process on a second signal, saying what is lost; the thread or Python's
        handler, whichever comes first (the other waits here until the exit)."""
        with self._exiting:
            self._say(f"{signal.Signals(signum).name} again: stopping at once, without saving: "
                      "the steps since the last checkpoint are lost")  # fmt: skip
            os._exit(128 + signum)

    def _acknowledge(self, reader: socket.socket) -> None:
        """The thread that answers each signal as it arrives (the wakeup fd's bytes)."""
        seen = _Count()
        while True:
            try:
                got = reader.recv(64)
            except OSError:
                return
            if not got:  # closed by __exit__
                return
            for signum in got:
                if signum not in SIGNALS:
                    continue
                count = seen.add(signum)
                name = signal.Signals(signum).name
                if count == 0:  # the first one again: an echo
                    continue
                if count == 1:
                    self._say(f"{name}: {self.plan} (a second signal stops at once, without "
                              "saving)")  # fmt: skip
                else:
                    self._stop_now(signum)

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # handlers live there only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            try:
                previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            except ValueError:  # not the main thread of the main interpreter
                reader.close()
                writer.close()
                return self
            thread = threading.Thread(target=self._acknowledge, args=(reader,), daemon=True,
                                      name="acknowledge-signals")  # fmt: skip
            thread.start()
            self._wakeup = (previous, reader, writer, thread)
        return self

    def __exit__(self, *exc) -> None:
        if self._wakeup is not None:
            previous, reader, writer, thread = self._wakeup
            signal.set_wakeup_fd(previous)
            writer.close()  # the thread's recv returns empty
            thread.join(timeout=5)
            reader.close()
            self._wakeup = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def saving(checkpoint: bool) -> str:
    """How a stopped run ends, for its log line."""
    return "with a checkpoint" if checkpoint else "without a checkpoint (train.checkpoint=false)"


def stopped(summary: dict, workdir: pathlib.Path, checkpoint: bool, command: str) -> str:
    """The last lines of a run that a signal stopped (``summary``: :func:`train`'s): the step,
    the last evaluation and its step, where the checkpoint is and the ``command`` that
    continues from it."""
    step, loss, at = summary["steps"], summary["final_eval_loss"], summary["eval_step"]
    evaluated = f"; last evaluation {loss:.4f} at step {at}" if loss is not None else ""
    if checkpoint:
        then = f"checkpoint in {workdir}/checkpoints; to continue:\n  {command}"
    else:
        then = "nothing saved (train.checkpoint=false): the same command starts from step 0"
    return f"stopped by {summary['preempted']} at step {step}{evaluated}; {then}"


def _prctl() -> Callable | None:
    """libc's ``prctl`` on Linux, else None."""
    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def launcher_tie(grace: float) -> tuple[dict[str, str], Callable[[], None] | None]:
    """What the launcher (this process) gives each process it starts so that the process stops
    when the launcher dies: environment variables for :func:`watch_launcher` and, on Linux, a
    ``preexec_fn`` that sets SIGTERM as the parent-death signal. Call ``subprocess.Popen`` from
    the main thread: the kernel sends the signal when the thread that forked ends."""
    launcher, prctl = os.getpid(), _prctl()
    if prctl is None:
        return {LAUNCHER_ENV: f"{launcher} {grace}"}, None
    set_death_signal = prctl

    def die_with_launcher() -> None:  # in the child, between fork and exec
        # until exec the launcher's own SIGTERM handler is in place here: a parent-death signal
        # arriving now would only set its flag, which exec drops
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        set_death_signal(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != launcher:  # it died before prctl: nobody would signal this process
            os._exit(1)

    return {LAUNCHER_ENV: f"{launcher} {grace}"}, die_with_launcher


def _parent_death_signal() -> int:
    """This thread's parent-death signal (0: none); a new thread starts without one."""
    prctl = _prctl()
    if prctl is None:
        return 0
    sig = ctypes.c_int(0)
    return sig.value if prctl(_PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0) == 0 else 0


def watch_launcher(environ=os.environ, *, poll: float = 0.2) -> threading.Thread | None:
    """In a process started by ``diloco_jax.launch`` (``environ`` names it): a daemon thread that
    waits for the launcher's death, then sends this process SIGTERM (unless the kernel's
    parent-death signal does), waits the launcher's grace and kills this process. None (and no
    thread) in a process the launcher did not start. Call it from the main thread, the one that
    holds the parent-death signal."""
    tie = environ.pop(LAUNCHER_ENV, None)  # not for the processes this one starts
    if tie is None:
        return None
    launcher, grace = int(tie.split()[0]), float(tie.split()[1])
    kernel_signals = _parent_death_signal() == signal.SIGTERM  # asked here: the thread has none

    def watch() -> None:
        while os.getppid() == launcher:  # an orphan's parent is another process
            time.sleep(poll)
        if not kernel_signals:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        try:
            print(f"the launcher (pid {launcher}) died and this process did not stop within "
                  f"{grace:g} s: killing it", file=sys.stderr, flush=True)  # fmt: skip
        except OSError:  # its terminal may be gone with it
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="watch-launcher", daemon=True)
    thread.start()
    return thread
