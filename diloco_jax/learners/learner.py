"""A run as a learner: its replicas take their inner steps as in any run (the step with its
syncs left out: :class:`~diloco_jax.runtime.chunked.LocalOnly`), and at each sync the
learner's mean pseudo-gradient goes to the syncer, which answers with the next anchor.

At a sync boundary (between calls; ``outer.sync_every`` a multiple of ``train.log_every``):

1. ``contribution``: the core's own part of a sync for each replica
   (:meth:`~diloco_jax.algorithm.Diloco.contribution`): the weighted mean of the learner's
   replicas' pseudo-gradients (the in-job collective; a replica whose own is not finite left
   out) and their mean weight.
2. The mean goes to the syncer with the learner's weight (its examples this round: replicas
   contributing x batch rows x steps) and the round it was computed against; the reply is the
   anchor of the next round, once every learner of the round has pushed (or the round's
   deadline passed).
3. ``restart``: each replica restarts from that anchor as a sync lands in the core
   (:meth:`~diloco_jax.algorithm.Diloco.restart`); the inner optimizer's state is kept.

A refused push (the learner missed a round, or was dropped) makes the learner join again and
restart from the syncer's current anchor: the work since its last sync is lost, and said so.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
import uuid
from typing import Any

import jax
import numpy as np

from diloco_jax.algorithm import state as state_lib
from diloco_jax.base.access import TOKEN_ENV
from diloco_jax.base.axes import REPLICA
from diloco_jax.base.errors import ConfigError
from diloco_jax.learners import service, wire

# the keys every learner must share with the syncer: what its outer step and merge mean
SHARED_KEYS = ("algorithm", "outer.optimizer", "outer.learning_rate", "outer.momentum",
               "outer.nesterov", "outer.sync_every", "outer.schedule", "outer.warmup",
               "outer.b1", "outer.b2", "outer.eps", "outer.weight_decay", "outer.mode",
               "outer.final_lr_fraction", "compress.codec", "streaming.fragments",
               "syncer.learners", "seed", "train.total_steps")  # fmt: skip


def shared_keys(flat: dict[str, Any]) -> dict[str, Any]:
    """The values of :data:`SHARED_KEYS` in a flat config (``config.keys(cfg)``)."""
    return {k: flat[k] for k in SHARED_KEYS if k in flat}


def configured_token(token_file: str, environ=os.environ) -> str:
    """The token the config names: the file's contents, else ``$DILOCO_SERVE_TOKEN``, else
    empty."""
    text = pathlib.Path(token_file).read_text().strip() if token_file else ""
    return text or environ.get(TOKEN_ENV, "")


def token(token_file: str, environ=os.environ) -> str:
    """The syncer's token as a learner needs it (:func:`configured_token`, which must exist)."""
    text = configured_token(token_file, environ)
    if not text:
        raise ConfigError(f"a learner needs the syncer's token: syncer.token_file or ${TOKEN_ENV}")
    return text


class Learner:
    """The learner's side of the rounds for a run's ``algorithm`` and replica-stacked state."""

    def __init__(self, client: service.Client, algorithm, *, learner: int, keys: dict,
                 rows_per_round: int, heartbeat: float, log):  # fmt: skip
        self.client, self.algorithm, self.learner, self.keys = client, algorithm, learner, keys
        self.rows_per_round, self.log = rows_per_round, log
        self.generation, self.round = 0, 0
        self.finished = False  # the syncer has closed the run's last round (syncer.rounds)
        self.lost_rounds = 0
        self.last: dict = {}  # the last round, as the run's ``round`` event reports it
        axes = state_lib.vmap_axes(algorithm.kinds)
        contribute = jax.vmap(algorithm.contribution, in_axes=(axes,), out_axes=(axes, 0, 0),
                              axis_name=REPLICA)  # fmt: skip
        self._contribute = jax.jit(contribute)
        self._restart = jax.jit(jax.vmap(algorithm.restart, in_axes=(axes, None), out_axes=axes))
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._heartbeats, args=(heartbeat,), daemon=True,
                                       name="learner-heartbeat")  # fmt: skip
        self.incarnation = uuid.uuid4().hex[:8]

    # ---- joining ----------------------------------------------------------------------------

    def join(self, state):
        """Joins the syncer with this run's anchor; returns ``state`` restarted from the
        syncer's anchor (its own where it is the first learner)."""
        arrays = self._join(state.anchor)
        return self._restart(state, wire.unnamed(state.anchor, arrays))

    def _join(self, anchor) -> dict:
        f, arrays = self.client.call("Join", {"learner": self.learner,
                                              "describe": wire.describe(anchor),
                                              "keys": self.keys}, wire.named(anchor))  # fmt: skip
        self.generation, self.round = int(f["generation"]), int(f["round"])
        self.finished = bool(f.get("finished"))
        self.log.info("joined the syncer at %s as learner %d (generation %d) at round %d",
                      self.client.address, self.learner, self.generation, self.round)  # fmt: skip
        if not self._beats.is_alive():
            self._beats.start()
        return arrays

    def _heartbeats(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                f, _ = self.client.call("Heartbeat", {"learner": self.learner,
                                                      "generation": self.generation},
                                        timeout=every * 2)  # fmt: skip
            except (service.RefusedBySyncer, ConnectionError) as e:
                self.log.debug("heartbeat: %s", e)

    # ---- a sync -----------------------------------------------------------------------------

    def sync(self, state):
        """The round at a sync boundary: push, wait, restart (see the module's docstring)."""
        state, mean_R, total_w_R = self._contribute(state)
        mean = jax.tree.map(lambda x: np.asarray(x[0]), mean_R)
        total_w = float(np.asarray(total_w_R[0]))
        replicas = int(np.asarray(total_w_R).shape[0])
        weight = total_w * replicas * self.rows_per_round
        names = wire.leaf_names(state.anchor)
        fields = {"learner": self.learner, "generation": self.generation, "round": self.round,
                  "weight": weight}  # fmt: skip
        pushed = dict(zip(names, mean, strict=True))
        start, sent, received = time.monotonic(), self.client.bytes_sent, self.client.bytes_received
        state, f = self._push(state, fields, pushed)
        self.last = {"base_round": fields["round"], "round": self.round,
                     "late": int(f.get("late", 0)), "seconds_waited": time.monotonic() - start,
                     "bytes_sent": self.client.bytes_sent - sent,
                     "bytes_received": self.client.bytes_received - received,
                     "restarted": bool(f.get("restarted"))}  # fmt: skip
        return state

    def _push(self, state, fields: dict, pushed: dict):
        """Push, then restart from the syncer's answer; returns ``(state, reply fields)``."""
        try:
            f, arrays = self.client.call("Push", fields, pushed)
        except service.RefusedBySyncer as e:
            base = self.round
            self.log.warning("the syncer refused this learner's push (%s): joining again", e)
            arrays = self._join(state.anchor)
            if self.round != base:  # the syncer moved on: this round's work is lost
                self.lost_rounds += 1
                self.log.warning("the syncer is at round %d: restarting from its anchor (the "
                                 "steps since round %d are in it only if that round closed with "
                                 "them)", self.round, base)  # fmt: skip
                restarted = {"round": self.round, "restarted": True}
                return self._restart(state, wire.unnamed(state.anchor, arrays)), restarted
            # the same round (a restarted syncer that does not know this learner): push again
            fields = {**fields, "generation": self.generation}
            f, arrays = self.client.call("Push", fields, pushed)
        if f.get("late"):
            self.log.info("this learner's push was %d round(s) late: merged into round %d",
                          f["late"], f["round"] - 1)  # fmt: skip
        self.round, self.finished = int(f["round"]), bool(f.get("finished"))
        if self.finished:
            self.log.info("the syncer has closed the run's last round (%d): this learner ends "
                          "with its anchor", self.round)  # fmt: skip
        return self._restart(state, wire.unnamed(state.anchor, arrays)), f

    def close(self) -> None:
        self._stop.set()
        try:
            self.client.call("Leave", {"learner": self.learner, "generation": self.generation},
                             timeout=5.0)  # fmt: skip
        except (service.RefusedBySyncer, ConnectionError) as e:
            self.log.debug("leave: %s", e)
        self.client.close()


def connect(cfg, algorithm, flat_config: dict, log) -> Learner:
    """The learner of a run with ``syncer.address``, not yet joined."""
    sy = cfg.syncer
    client = service.Client(sy.address, token(sy.token_file), timeout=sy.timeout * 4 + 60)
    rows = cfg.data.batch_size * cfg.outer.sync_every
    return Learner(client, algorithm, learner=sy.learner, keys=shared_keys(flat_config),
                   rows_per_round=rows, heartbeat=sy.heartbeat, log=log)  # fmt: skip
