"""A syncer shard that follows shard 0 (``syncer.shard`` > 0, issue 62): it asks shard 0 how
each round closed and closes its own round exactly so.

Shard 0 decides every round (membership, quorum, grace, deadlines, drops, lateness, the
examples budget: :class:`~diloco_jax.learners.syncer.Syncer` with ``decides=True``); the
other shards take the same pushes (each its part of every push, under the same push ids) but
never close a round by their own clocks. :class:`Follower` is a thread that calls shard 0's
``Decision`` for the round this shard is at (shard 0 answers once that round has closed, or
with none after :data:`~diloco_jax.learners.service.DECISION_WAIT` seconds: it asks again),
then :meth:`~diloco_jax.learners.syncer.Syncer.follow` merges exactly the decision's pushes,
waiting for those that have not reached this shard yet (their learners' retries bring them).
Every round's decision is in shard 0's checkpoints, so a restarted shard 0 still answers for
the rounds it closed; a restarted follower starts from its own newest checkpoint and asks for
the round it is at. A shard 0 that cannot be reached is retried by the client, whose log
lines name its address.
"""

from __future__ import annotations

import logging
import threading

from diloco_jax.learners import service
from diloco_jax.learners.rounds import Decision
from diloco_jax.learners.syncer import Refused, Syncer

log = logging.getLogger("diloco_jax")


class Follower:
    """Shard ``index``'s thread that closes ``syncer``'s rounds as shard 0 (reached through
    ``client``, calling as the shard) decided them; :meth:`stop` ends it."""

    def __init__(self, syncer: Syncer, client: service.Client, index: int):
        self.syncer, self.client, self.index = syncer, client, index
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="follower")

    def start(self) -> Follower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.client.close()  # ends a call in flight
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            rnd = self.syncer.round
            try:
                f, _ = self.client.call("Decision", {"round": rnd},
                                        timeout=service.DECISION_WAIT + 30)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - said, and asked again
                if self._stop.is_set():
                    return  # the channel closed under the call
                log.warning("syncer shard %d: asking shard 0 (%s) how round %d closed: %s",
                            self.index, self.client.address, rnd, e)  # fmt: skip
                self._stop.wait(2.0)
                continue
            if f.get("decision") is None:
                continue  # not closed yet: ask again
            decision = Decision.from_json(f["decision"])
            said = False
            while not self._stop.is_set():
                try:
                    missing = self.syncer.follow(decision, timeout=5.0)
                except Refused as e:
                    log.error("syncer shard %d: %s", self.index, e)
                    self._stop.wait(2.0)
                    break
                if not missing:
                    break
                if not said:  # their learners' pushes (or retries) will bring them
                    log.info("syncer shard %d: round %d closed on shard 0; waiting here for "
                             "the pushes of learner(s) %s", self.index, rnd,
                             ", ".join(map(str, missing)))  # fmt: skip
                    said = True
