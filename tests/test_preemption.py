"""A signal is acknowledged at once, whatever the main thread is doing (issue 61 finding 5): a
default run took 39 s to answer SIGTERM, because Python runs a handler only between bytecodes,
and a compiled step, a compile or a save holds the main thread in C for that long. A second
signal then stops at once. And a run whose workdir holds no checkpoint says so as it starts."""

from __future__ import annotations

import logging
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

from diloco_jax.train import train
from tests.test_checkpoint import tiny

# a child whose main thread sits in one compiled call that never ends (2^62 steps of a loop XLA
# cannot fold: 2^31 alone took 2 s on a fast core, short enough to end between two signals)
CHILD = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from diloco_jax.run.preemption import Preemption
    def inner(i, v):
        return jax.lax.fori_loop(0, 2**31 - 1, lambda j, w: jnp.sin(w) + 0.5, v)
    spin = jax.jit(lambda x: jax.lax.fori_loop(0, 2**31 - 1, inner, x))
    compiled = spin.lower(jnp.float32(0.5)).compile()
    with Preemption("stopping at the next call boundary, with a checkpoint"):
        print("computing", flush=True)
        compiled(jnp.float32(0.5)).block_until_ready()
        print("computed", flush=True)
""")


class _Lines:
    """A child's stream read line by line in a thread, so that a wait for a line has a
    deadline (a child that never says it would hold a plain read for its whole run)."""

    def __init__(self, stream):
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put("")  # the end

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        """The first line from here on holding ``text`` (empty: none within ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if not line or text in line:
                return line
        return ""


def test_a_signal_is_acknowledged_and_a_second_stops_at_once_while_a_step_runs():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = _Lines(child.stdout), _Lines(child.stderr)
    try:
        assert out.wait_for("computing", timeout=120), "".join(err.seen)
        child.send_signal(signal.SIGTERM)
        said = err.wait_for("SIGTERM")  # with Python's handler alone: after the call, minutes
        assert said.strip() == ("SIGTERM: stopping at the next call boundary, with a checkpoint "
                                "(a second signal stops at once, without saving)")  # fmt: skip
        child.send_signal(signal.SIGINT)  # still in the same compiled call
        assert "SIGINT again: stopping at once, without saving" in err.wait_for("again")
        assert child.wait(timeout=60) == 128 + signal.SIGINT
    finally:
        child.kill()
    assert out.wait_for("computed", timeout=5) == ""  # it did not wait for the call to end


def test_a_rerun_whose_workdir_holds_no_checkpoint_says_it_starts_from_step_0(tmp_path, capsys,
                                                                              caplog):  # fmt: skip
    """A run killed before its first save leaves its config.json and no checkpoint: the rerun
    warns that it starts from step 0; a first start says it as news."""
    caplog.set_level(logging.INFO, logger="diloco_jax")  # an earlier test may have raised it
    cfg = tiny(**{"train.total_steps": 5, "train.log_every": 5, "train.eval_every": 5,
                  "train.checkpoint_every": 0})  # fmt: skip
    train(cfg, tmp_path, show_progress=False)
    said = f"no checkpoint in {tmp_path / 'checkpoints'}: starting from step 0"
    first = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines()
             if "no checkpoint in" in line]  # fmt: skip
    assert first == [said]
    for saved in (tmp_path / "checkpoints").iterdir():  # as if killed before its first save
        if saved.name.isdigit():
            shutil.rmtree(saved)
    train(cfg, tmp_path, show_progress=False)
    again = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines()
             if "no checkpoint in" in line]  # fmt: skip
    assert again == [f"{said} (this workdir's earlier start saved none)"]


def test_the_first_signal_delivered_twice_within_a_second_counts_once(monkeypatch):
    """``timeout`` (or a kill of the process group) signals uv's child and uv forwards the same
    SIGTERM: one stop, not a second signal that exits without saving. Another signal, or the
    same one a second later, is a second."""
    from diloco_jax.run import preemption

    now = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: now[0])
    count = preemption._Count()
    assert count.add(signal.SIGTERM) == 1
    now[0] += 0.2
    assert count.add(signal.SIGTERM) == 0  # the echo
    assert count.add(signal.SIGINT) == 2
    later = preemption._Count()
    later.add(signal.SIGTERM)
    now[0] += 1.5
    assert later.add(signal.SIGTERM) == 2
