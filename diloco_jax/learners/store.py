"""What a syncer keeps on disk: its tape (``WORKDIR/syncer.jsonl``, one JSON object per event)
and its checkpoints (orbax, under ``WORKDIR/checkpoints/<round>``, written atomically: a
temporary folder renamed when complete; the last three kept). A damaged newest checkpoint
(truncated, corrupt) is named in one line and the one before it restored, as a run's resume
does; one written by another version of diloco-jax stops the syncer."""

from __future__ import annotations

import json
import logging
import pathlib
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from diloco_jax.learners.identity import printable
from diloco_jax.runtime import checkpoint

log = logging.getLogger("diloco_jax")
# orbax's saves by two managers of one process at once collide (two syncer shards served from
# one process, as the tests do, saving the same round); a syncer of its own never waits on it
_SAVING = threading.Lock()


class Store:
    """The tape and the checkpoints of the syncer in ``workdir``."""

    def __init__(self, workdir: pathlib.Path):
        self.tape = (workdir / "syncer.jsonl").open("a")
        self._writing = threading.Lock()
        self.mngr = checkpoint.manager(workdir, max_to_keep=3)

    def event(self, kind: str, rnd: int, **fields) -> None:
        """One line in the tape (and the log): ``kind``, the syncer's round, the Unix time."""
        self.taped(kind, rnd, **fields)
        # a caller's text (a push id, a leaf name) escaped: no forged lines in the log
        log.info("syncer: %s %s", kind, " ".join(f"{k}={printable(v)}" for k, v in fields.items()))

    def taped(self, kind: str, rnd: int, **fields) -> None:
        """:meth:`event` in the tape alone (where the log has a line of its own about it)."""
        line = {"event": kind, "round": rnd, "time": time.time(), **fields}
        with self._writing:  # events come from the served calls' threads too
            self.tape.write(json.dumps(line) + "\n")
            self.tape.flush()

    def save(self, rnd: int, anchor: list, outer_state, meta: dict,
             groups: dict[str, list] | None = None) -> None:  # fmt: skip
        """Round ``rnd``'s anchor and outer state, with ``meta`` (JSON-able) and ``groups``
        (lists of arrays by name: with compressed answers ``sent``, the anchor the learners
        hold, :mod:`.answers`; with centered clipping ``center``, the last merge)."""
        state = {"anchor": anchor, "outer": jax.tree.leaves(outer_state), **(groups or {})}
        with _SAVING:
            checkpoint.save(self.mngr, rnd, state, meta, wait=True)

    def restore(self, like_of: Callable[[dict], Any]) -> tuple[int, dict, Any] | None:
        """``(round, meta, state)`` of the newest readable checkpoint (``like_of(meta)``: the
        structure its state is restored into), or None where there is none. Each newer one that
        is damaged is named in one line with the round started from, and recorded in the tape
        (:func:`checkpoint.newest_readable`, shared with a run's resume)."""

        def read(step: int) -> tuple[int, dict, Any]:
            meta = checkpoint.saved_meta(self.mngr, step)["config"]
            return step, meta, checkpoint.restore(self.mngr, like_of(meta), step)

        def report(step: int, error: Exception, started: int | None) -> None:
            where = self.mngr.directory / str(step)
            then = ("no checkpoint before it was restored" if started is None
                    else f"starting from round {started}")  # fmt: skip
            log.warning("syncer: checkpoint %s is damaged (%s); %s", where,
                        checkpoint.described(error, 160), then)  # fmt: skip
            self.taped("damaged_checkpoint", step, path=str(where), error=type(error).__name__)

        # any damage, a mismatch of its own parts included, means: the previous round's
        return checkpoint.newest_readable(self.mngr, read, report, fatal=(checkpoint.SchemaError,))

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()
        self.tape.close()
