"""Stands in for ``diloco_jax.train`` in the tests of the launcher's tie to its processes.

``python -m tests.launched_child DIR [ID ...]`` appends a line to ``DIR/<pid>.sigterm`` for each
SIGTERM and exits 0 at the first one, unless its ``JAX_PROCESS_ID`` is one of the IDs (then it
ignores SIGTERM); it ties itself to the launcher (as train does), writes ``DIR/<pid>.ready``, and
waits.
"""

import os
import pathlib
import signal
import sys
import time

from diloco_jax.run.preemption import watch_launcher


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    stubborn = os.environ.get("JAX_PROCESS_ID") in sys.argv[2:]

    def on_sigterm(signum, frame):
        with open(out / f"{os.getpid()}.sigterm", "a") as f:
            f.write("SIGTERM\n")
        if not stubborn:  # at once: an interpreter shutdown with jax loaded may outlast the grace
            os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    watch_launcher()
    (out / f"{os.getpid()}.ready").touch()
    deadline = time.monotonic() + 120  # never an orphan for long, whatever the test does
    while time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
