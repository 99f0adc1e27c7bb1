"""Graceful preemption: SIGTERM or SIGINT asks the training loop to stop at the next call
boundary, where it saves a checkpoint and returns; a second signal exits at once."""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """Context manager; ``requested`` holds the first signal's name once one arrived."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if self.requested is not None:
            os._exit(128 + signum)  # second signal: at once, like an unhandled one
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # handlers live there only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
