"""A learner's calls to a sharded syncer (``syncer.shards`` S > 1, issue 62), behind the one
client interface a learner has (:class:`~diloco_jax.learners.service.Client`'s ``call``), so the
learner's rounds are the same code whatever S.

Every call goes to every shard, each with its own client, credential check and retries:

* ``Join``: the learner's model, described whole, is planned into parts
  (:func:`~diloco_jax.learners.shards.plan`, from the description alone: every learner and
  shard gets the same; with streaming fragments each fragment's leaves over every shard, each
  shard told its leaves' fragments) and each shard joined with its part's description and
  piece of the anchor (:func:`~.shards.split`); the answer is the anchor gathered from every
  shard's piece (:func:`~.shards.gather`). Shards at different rounds (a following shard a
  moment behind shard 0's decision) are joined again, briefly, until they agree.
* ``Push``: the push, encoded whole through the run's codec, cut into each shard's part
  (:func:`~.shards.cut`: whole blocks, bit for bit the whole push's), with the same push id
  (each shard merges it once; shard 0's decision names pushes by it), the learner's
  generation at that shard, and whether the whole mean is finite (a shard sees its own values
  only: every shard leaves a non-finite push out alike). The shards are called in parallel;
  the answer is the new anchor gathered from theirs. With ``compress.answers`` each shard's
  answer is its own part's change, rebuilt and checked against its own checksum here
  (:class:`~.answers.Held`, one per shard).
* ``Heartbeat``: shard 0's in the caller's thread, the others' in the background, never
  queued behind a push that waits for its round nor behind a shard that is down;
  ``Leave``: every shard at once.

A shard that cannot be reached is retried by its own client, whose log lines name its
address; a refusal by any shard is raised as the learner's refusal (it joins every shard
again).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import numpy as np

from diloco_jax.learners import answers, service, shards, wire

AGREE_TRIES = 50  # joins again while the shards' rounds differ, 0.2 s apart


def finite(message: dict[str, np.ndarray]) -> bool:
    """Whether a push's message decodes to finite values: its float arrays (leaves, block
    scales, bf16 and fp8 codes) are all finite (codes times finite scales are)."""
    for a in message.values():
        if np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_:
            continue
        if not np.isfinite(np.asarray(a, np.float32)).all():
            return False
    return True


class Fanout:
    """A learner's client of the syncer shards reached by ``clients`` (shard 0's first), its
    pushes through ``codec`` (None: float32), their answers compressed or not."""

    def __init__(self, clients: list[service.Client], codec=None, compress_answers: bool = False,
                 sleep=time.sleep):  # fmt: skip
        self.clients, self.codec, self.sleep = clients, codec, sleep
        for k, client in enumerate(clients):  # its lines say which shard, and its address
            client.label = f"syncer shard {k}: "
        self.held = [answers.Held(codec if compress_answers else None) for _ in clients]
        self.generations = [0] * len(clients)
        self.describe: list[list] = []
        self.parts: list[shards.Part] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(
            2 * len(clients), thread_name_prefix="shard")  # fmt: skip
        self._beats = concurrent.futures.ThreadPoolExecutor(
            len(clients), thread_name_prefix="shard-beat")  # fmt: skip
        self._beating: list[concurrent.futures.Future | None] = [None] * len(clients)

    @property
    def address(self) -> str:
        return ",".join(c.address for c in self.clients)

    @property
    def timeout(self) -> float:
        return self.clients[0].timeout

    @property
    def patience(self) -> float:
        return self.clients[0].patience

    @patience.setter
    def patience(self, seconds: float) -> None:
        for c in self.clients:
            c.patience = seconds

    def call(self, name: str, fields: dict, arrays: dict | None = None,
             timeout: float | None = None, counts: list | None = None,
             ) -> tuple[dict, dict[str, np.ndarray]]:  # fmt: skip
        if name == "Join":
            return self._join(fields, arrays or {}, timeout, counts)
        if name == "Push":
            return self._push(fields, arrays or {}, timeout, counts)
        if name == "Heartbeat":
            return self._heartbeat(fields, timeout)
        replies = self._all([
            lambda k=k: self.clients[k].call(name, {**fields, "generation": self.generations[k]},
                                             None, timeout, counts)
            for k in range(len(self.clients))])  # fmt: skip
        return replies[0]

    def _heartbeat(self, fields: dict, timeout) -> tuple[dict, dict]:
        """Shard 0's heartbeat in this thread (it drops the silent); every other shard's in
        the background, one at a time each: a shard that is down, its client retrying, holds
        up neither shard 0's heartbeats nor the others'."""
        for k in range(1, len(self.clients)):
            last = self._beating[k]
            if last is None or last.done():
                self._beating[k] = self._beats.submit(
                    self.clients[k].call, "Heartbeat",
                    {**fields, "generation": self.generations[k]}, None, timeout)  # fmt: skip
        return self.clients[0].call("Heartbeat", {**fields, "generation": self.generations[0]},
                                    None, timeout)  # fmt: skip

    def _all(self, calls: list) -> list:
        """Every shard's call (thunks), in parallel; the first error raised once all ended."""
        futures = [self._pool.submit(call) for call in calls]
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    def _join(self, fields: dict, anchor: dict, timeout, counts) -> tuple[dict, dict]:
        self.describe = [list(d) for d in fields["describe"]]
        fragments = fields.get("fragments")
        try:
            self.parts = shards.plan(self.describe, len(self.clients), self.codec, fragments)
        except ValueError as e:
            raise service.RefusedBySyncer(f"Join: {e}") from None
        mine = [{"fragments": [fragments[i] for i in part.leaves]} if fragments else {}
                for part in self.parts]  # fmt: skip
        pieces = shards.split(anchor, self.describe, self.parts, self.codec)
        for _ in range(AGREE_TRIES):
            replies = self._all([
                lambda k=k: self.clients[k].call("Join", {
                    **fields, **mine[k], "describe": shards.described(
                        self.describe, self.parts[k], self.codec)}, pieces[k], timeout, counts)
                for k in range(len(self.clients))])  # fmt: skip
            rounds = {int(f["round"]) for f, _ in replies}
            if len(rounds) == 1:
                break
            self.sleep(0.2)  # a following shard is closing the round shard 0 has closed
        else:
            raise wire.WireError(f"the syncer shards stay at different rounds {sorted(rounds)}")
        self.generations = [int(f["generation"]) for f, _ in replies]
        got = [h.joined(int(f["round"]), a)
               for h, (f, a) in zip(self.held, replies, strict=True)]  # fmt: skip
        first = replies[0][0]
        return {**first, "finished": any(f.get("finished") for f, _ in replies)}, self._whole(got)

    def _push(self, fields: dict, message: dict, timeout, counts) -> tuple[dict, dict]:
        ok = finite(message)
        replies = self._all([
            lambda k=k: self.clients[k].call("Push", {
                **fields, "generation": self.generations[k], "finite": ok,
                **self.held[k].asks()}, shards.cut(message, self.describe, self.parts[k],
                                                   self.codec), timeout, counts)
            for k in range(len(self.clients))])  # fmt: skip
        rounds = [int(f["round"]) for f, _ in replies]
        if len(set(rounds)) > 1:
            raise wire.WireError(f"the syncer shards answered a push at rounds {rounds}")
        got = [h.took(f, a) for h, (f, a) in zip(self.held, replies, strict=True)]
        first = replies[0][0]
        reply: dict[str, Any] = {**first, "finished": any(f.get("finished") for f, _ in replies)}
        reply.pop("answer", None)  # each shard's answer was rebuilt here: the whole is plain
        return reply, self._whole(got)

    def _whole(self, pieces: list[dict]) -> dict[str, np.ndarray]:
        if any(p.size for p in self.parts):
            return self._gathered(pieces)
        # whole leaves: every shard's by name, in the model's order (a streaming round's
        # answer holds its fragment's leaves alone, each from its shard)
        got = {n: a for piece in pieces for n, a in piece.items()}
        return {str(n): got[str(n)] for n, _, _ in self.describe if str(n) in got}

    def _gathered(self, pieces: list[dict]) -> dict[str, np.ndarray]:
        try:
            return shards.gather(pieces, self.describe, self.parts, self.codec)
        except ValueError as e:
            raise wire.WireError(str(e)) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._beats.shutdown(wait=False)
        for c in self.clients:
            c.close()
