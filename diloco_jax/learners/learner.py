"""A run as a learner: its replicas take their inner steps as in any run (the step with its
syncs left out: :class:`~diloco_jax.runtime.chunked.LocalOnly`), and at each sync the
learner's mean pseudo-gradient goes to the syncer, which answers with the next anchor.

At a sync boundary (between calls; ``outer.sync_every`` a multiple of ``train.log_every``):

1. ``contribution``: the core's own part of a sync for each replica
   (:meth:`~diloco_jax.algorithm.Diloco.contribution`): the weighted mean of the learner's
   replicas' pseudo-gradients (the in-job collective; a replica whose own is not finite left
   out) and their mean weight.
2. The mean goes to the syncer, encoded with the run's codec (:mod:`.payload`; with DCT
   momentum and SparseLoCo, the replicas' own messages: their accumulators stay here), with the
   learner's weight (its examples this round: replicas contributing x batch rows x steps), its
   mean training loss over the round (:meth:`Learner.observe`: what the syncer's status page
   charts) and the round it is for; the reply is the anchor of the next round, once every
   learner of the round has pushed (or the round's rule closed it without them).
3. ``restart``: each replica restarts from that anchor as a sync lands in the core
   (:meth:`~diloco_jax.algorithm.Diloco.restart`); the inner optimizer's state is kept.

Overlapped rounds (``outer.mode = delayed``): the push of step 2 goes on in a thread while the
replicas train on; step 3 takes the answer of the push before (at the first sync there is none:
the replicas restart from the anchor they had). This is the simulator's delayed outer step,
where each sync applies the previous sync's mean, with the communication really behind the
computation: a sync waits only when the round of the push before has not closed yet.

Streaming DiLoCo (``streaming.fragments`` F > 1, :class:`~diloco_jax.algorithm.plan.SyncPlan`):
a sync every ``outer.sync_every / F`` steps, each of one fragment, the one the core's plan
starts at that sync (:meth:`~diloco_jax.algorithm.plan.SyncPlan.round_fragment` of the round):
step 1 takes that fragment's leaves alone (with its own exchange state), the push and the
answer hold them alone, and step 3 lands them (with ``streaming.mix``: ``params_f = mix *
params_f + (1 - mix) * anchor_f``) as the simulator's streaming sync does. With
``streaming.overlap`` tau > 0 the push goes on in the background and the answer lands tau
steps later (:meth:`Learner.landing`, :meth:`Learner.land`), as the simulator's does; the
run's last sync lands at once. Which leaf is in which fragment the join tells the syncer.

With ``compress.answers`` the answer is the anchor's change through the codec: the sending
thread adds it to the anchor the learner holds (:class:`~diloco_jax.learners.answers.Held`),
and the replicas restart from that rebuilt anchor, every learner's the same.

A refused push (the learner missed a round, or was dropped) makes the learner join again and
restart from the syncer's current anchor: the work since its last sync is lost, and said so.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.base.axes import LOCAL_REPLICA, REPLICA
from diloco_jax.config import recipe
from diloco_jax.learners import answers, credentials, fanout, guard, payload, service, wire
from diloco_jax.runtime import fsdp, parallel

# the keys every learner must share with the syncer: what its outer step and merge mean
SHARED_KEYS = ("algorithm", "outer.optimizer", "outer.learning_rate", "outer.momentum",
               "outer.overlap_momentum",
               "outer.nesterov", "outer.sync_every", "outer.schedule", "outer.warmup",
               "outer.b1", "outer.b2", "outer.eps", "outer.weight_decay", "outer.mode",
               "outer.final_lr_fraction", "compress.codec", "compress.block",
               "compress.topk_fraction", "compress.min_size", "compress.error_feedback",
               "compress.answers", "compress.dct_chunk", "compress.dct_topk",
               "compress.dct_beta", "compress.sparse_chunk", "compress.sparse_topk",
               "compress.sparse_beta", "compress.sparse_bits",
               "streaming.fragments",
               "syncer.learners", "syncer.shards", "seed", "train.total_steps")  # fmt: skip


# seconds a learner asked to stop keeps trying a syncer it cannot reach: then it saves and ends
# (the launcher's --grace, 30 s by default, must leave it time to reach its sync and save)
STOP_PATIENCE = 10.0


def shared_keys(flat: dict[str, Any]) -> dict[str, Any]:
    """The values of :data:`SHARED_KEYS` in a flat config (``config.keys(cfg)``)."""
    return {k: flat[k] for k in SHARED_KEYS if k in flat}


class Exchanged(NamedTuple):
    """A push and the syncer's answer."""

    fields: dict  # the push's, as sent
    reply: dict  # the answer's fields: the round it goes on from, late, finished
    arrays: dict  # the answer's anchor, by name
    counts: list  # (bytes sent, bytes received) of each call it took
    seconds: float  # from sending to the answer
    anchor: dict  # the anchor it was computed from, by name (what the answer's looks like)
    error: Exception | None = None  # what went wrong on process 0 (raised on every process)


class Learner:
    """The learner's side of the rounds for a run's ``algorithm`` and replica-stacked state."""

    def __init__(self, client: service.Client, algorithm, *, learner: int, keys: dict,
                 rows_per_round: int, heartbeat: float, log, codec=None,
                 overlap: bool = False, mesh=None, replicas: int = 1, learners: int = 1,
                 outer_scale: float = 1.0, fsdp_specs=None,
                 compress_answers: bool = False):  # fmt: skip
        self.client, self.algorithm, self.learner, self.keys = client, algorithm, learner, keys
        self.codec = codec  # how the push travels (:mod:`.payload`); None: float32; a
        # DctConfig: the replicas' messages of DCT momentum or SparseLoCo
        # compress.answers: the anchor held (host copy) and rebuilt from each answer's change
        self.held = answers.Held(codec if compress_answers else None)
        # outer.mode = delayed or eager: train on while the push is on its way; eager: the
        # answer is the round's mean, and the learner takes the outer step (its own anchors)
        self.eager = algorithm.kinds.anchor == state_lib.PER_REPLICA
        self.overlap = overlap or self.eager
        self.outer_scale = outer_scale
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="push")
        self._inflight: concurrent.futures.Future | None = None
        self.rows_per_round, self.log = rows_per_round, log
        self.generation, self.round = 0, 0
        self.finished = False  # the syncer has closed the run's last round (syncer.rounds)
        self.lost_rounds = 0
        self.last: dict = {}  # the last round, as the run's ``round`` event reports it
        self._loss_sum, self._loss_count = 0.0, 0  # the finite training losses since the sync
        self.mesh = mesh  # the learner's own mesh (None: the simulator's layout)
        self.replicas = replicas  # the learner's replicas, on every process together
        self.lead = jax.process_index() == 0  # the one process of the learner that calls
        self._contribute, self._restart_placed, self._land_mean = _sync_parts(
            algorithm, mesh, learners, fsdp_specs)  # fmt: skip
        self.plan = algorithm.plan  # streaming: which fragment each round holds
        count = self.plan.fragments if self.streaming else 0
        self._fragment_parts = [_sync_parts(algorithm, mesh, learners, fsdp_specs, f)[:2]
                                for f in range(count)]  # fmt: skip
        self.assignment: list[int] = []  # streaming: each leaf's fragment (set at the join)
        # FSDP: the anchor is split over DATA; gathered whole before it is read on the host
        self._whole = None if fsdp_specs is None else jax.jit(
            lambda tree: tree, out_shardings=parallel.replicated_sharding(mesh))  # fmt: skip
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._heartbeats, args=(heartbeat,), daemon=True,
                                       name="learner-heartbeat")  # fmt: skip

    @property
    def streaming(self) -> bool:
        return self.algorithm.plan.fragments > 1

    def due(self, step: int) -> bool:
        """Whether a sync (:meth:`sync`) follows inner step ``step``: every ``outer.sync_every``
        steps, or with streaming fragments every ``outer.sync_every / F``."""
        return self.plan.starting(step)[0]

    def fragment(self, rnd: int) -> int | None:
        """The streaming fragment round ``rnd`` pushes and lands (None: every leaf)."""
        return self.plan.round_fragment(rnd) if self.streaming else None

    # ---- joining ----------------------------------------------------------------------------

    def join(self, state):
        """Joins the syncer with this run's anchor; returns ``state`` restarted from the
        syncer's anchor (its own where it is the first learner). Process 0 joins; the others
        of a learner of several processes receive what it got."""
        tree = self._anchor(state)
        anchor = wire.named(tree)
        if self.streaming:  # the core's own assignment, as its sync splits the anchor
            self.assignment = list(self.algorithm.fragment_of(tree, self.plan.fragments))
            fragments_lib.groups(self.assignment, self.plan.fragments)  # none empty
        reply, arrays, error = {}, {}, None
        if self.lead:
            try:
                arrays = self._join(anchor)
                reply = {"round": self.round, "finished": self.finished}
            except Exception as e:  # noqa: BLE001 - said to the other processes, then raised
                error = e
        reply, arrays = self._from_lead(reply, arrays, anchor, error)
        self.round = int(reply["round"])  # the same on every process
        return self._restart(state, arrays)

    def _anchor(self, state):
        """The learner's anchor on the host, as one: with eager timing every replica keeps its
        own (the same at a join), and replica 0's stands for them. A read from the devices
        (with FSDP a gather too): once a join or a sync, the rest take :meth:`_like`."""
        anchor = state.anchor if self._whole is None else self._whole(state.anchor)
        anchor = parallel.host_copy(anchor)
        return jax.tree.map(lambda x: x[0], anchor) if self.eager else anchor

    def _like(self, state):
        """What :meth:`_anchor` looks like, its shapes and dtypes (``jax.ShapeDtypeStruct``),
        without reading it: the structure an answer's anchor or mean is put into."""
        cut = 1 if self.eager else 0
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[cut:], x.dtype), state.anchor)

    def _restart(self, state, arrays: dict, fragment: int | None = None):
        """``state`` restarted from the anchor ``arrays`` (by name; host arrays, the same on
        every process); ``fragment``: only that streaming fragment's leaves land (``arrays``
        holds them, and may hold more)."""
        like = self._like(state)
        if fragment is None:
            anchor = wire.unnamed(like, arrays)
            return self._restart_placed(state, parallel.replicated(anchor, self.mesh))
        wanted = [d for d, f in zip(wire.describe(like), self.assignment, strict=True)
                  if f == fragment]  # fmt: skip
        got = [[n, list(arrays[n].shape), str(arrays[n].dtype)] for n, _, _ in wanted
               if n in arrays]  # fmt: skip
        problem = wire.first_mismatch(wanted, got)
        if problem:
            raise wire.WireError(f"the answer of streaming fragment {fragment}: {problem}")
        part = [np.asarray(arrays[n]) for n, _, _ in wanted]
        restart = self._fragment_parts[fragment][1]
        return restart(state, parallel.replicated(part, self.mesh))

    def _take(self, state, arrays: dict | None, own: dict | None = None,
              fragment: int | None = None):  # fmt: skip
        """``state`` after a round's answer: restarted from its anchor, or with eager timing the
        outer step taken here on its mean (:meth:`~diloco_jax.algorithm.Diloco.land_mean`).
        ``None``: the first overlapped sync's, no answer yet (the anchor moves by zero, the
        replicas restart from ``own``, their anchor by name as the sync read it; eager: by
        this replica's own share). ``fragment``: a streaming round's, whose leaves alone
        land."""
        if not self.eager:
            anchor = own if arrays is None else arrays
            assert anchor is not None  # the first overlapped sync passes its own
            return self._restart(state, anchor, fragment)
        like = self._like(state)
        mean = (jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), like) if arrays is None
                else wire.unnamed(like, arrays))  # fmt: skip
        return self._land_mean(state, parallel.replicated(mean, self.mesh), self.outer_scale)

    def _from_lead(self, reply: dict, arrays: dict, like: dict, error: Exception | None = None):
        """Process 0's ``(reply, arrays)`` on every process of the learner (``like``: arrays of
        the same names and shapes); process 0's ``error``, if any, raised on every process."""
        if jax.process_count() == 1:
            if error is not None:
                raise error
            return reply, arrays
        from jax.experimental import multihost_utils

        keys = ("round", "late", "finished", "restarted")
        sent = np.asarray([error is not None, *(int(reply.get(k, 0)) for k in keys),
                           self.generation], np.int32)  # fmt: skip
        got, arrays = multihost_utils.broadcast_one_to_all(
            (sent, arrays if self.lead and error is None else like))  # fmt: skip
        ints = [int(v) for v in np.asarray(got)]
        if ints[0]:
            if error is not None:
                raise error
            raise service.SyncerUnreachable("process 0 of this learner failed to reach the "
                                            "syncer (its log says why)")  # fmt: skip
        reply = {**reply, **dict(zip(keys, ints[1:5], strict=True))}
        self.generation, self.finished = ints[5], bool(reply["finished"])
        return reply, {n: np.asarray(a) for n, a in arrays.items()}

    def _join(self, anchor: dict[str, np.ndarray], counts: list | None = None) -> dict:
        described = [[n, list(a.shape), str(a.dtype)] for n, a in anchor.items()]
        # what it can train in a round: the syncer refuses a push that weighs more
        fields = {"learner": self.learner, "describe": described, "keys": self.keys,
                  "replicas": self.replicas, "rows": self.rows_per_round}  # fmt: skip
        if self.streaming:
            fields["fragments"] = self.assignment
        f, arrays = self.client.call("Join", fields, anchor, counts=counts)
        self.generation, self.round = int(f["generation"]), int(f["round"])
        self.finished = bool(f.get("finished"))
        self.log.info("joined the syncer at %s as learner %d (generation %d) at round %d",
                      self.client.address, self.learner, self.generation, self.round)  # fmt: skip
        if not self._beats.is_alive():  # process 0 alone calls (and heartbeats)
            self._beats.start()
        return self.held.joined(self.round, arrays)

    def _heartbeats(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                f, _ = self.client.call("Heartbeat", {"learner": self.learner,
                                                      "generation": self.generation},
                                        timeout=every * 2)  # fmt: skip
            except (service.RefusedBySyncer, ConnectionError) as e:
                self.log.debug("heartbeat: %s", e)

    # ---- a sync -----------------------------------------------------------------------------

    def observe(self, loss_NxR) -> None:
        """Takes a call's training losses (each step's, each replica's) into the round's mean
        that the next push carries; a loss that is not finite is left out (as its replica's
        pseudo-gradient is)."""
        loss = np.asarray(loss_NxR, np.float64)
        finite = loss[np.isfinite(loss)]
        self._loss_sum += float(finite.sum())
        self._loss_count += int(finite.size)

    def _round_loss(self) -> float | None:
        """The mean of the losses observed since the last sync (then forgotten); None where
        there are none, or where the mean is beyond what the syncer takes
        (:data:`~.guard.MAX_LOSS`): the push is merged all the same, without a loss."""
        total, count = self._loss_sum, self._loss_count
        self._loss_sum, self._loss_count = 0.0, 0
        mean = total / count if count else None
        return mean if mean is not None and abs(mean) <= guard.MAX_LOSS else None

    def sync(self, state, last: bool = False):
        """The round at a sync boundary: push, wait, restart (see the module's docstring);
        overlapped, the push goes on in the background and the restart takes the anchor of the
        push before. The ``last`` sync of a run waits for its push's answer (not restarting from
        it, as the simulator's delayed step does not), so the syncer has it before the run's
        final checkpoint."""
        fragment = self.fragment(self.round)
        contribute = self._contribute if fragment is None else self._fragment_parts[fragment][0]
        state, mean, total_w = contribute(state)
        mean, total_w = parallel.host_copy(mean), float(parallel.host_copy(total_w))
        replicas = self.replicas
        # the push's id: every retry of it carries the same, and the syncer merges it once
        fields = {"learner": self.learner, "generation": self.generation, "round": self.round,
                  "weight": total_w * replicas * self.rows_per_round,
                  "push": uuid.uuid4().hex}  # fmt: skip
        loss = self._round_loss()
        if loss is not None:  # what the syncer's status page charts
            fields["loss"] = loss
        names = wire.leaf_names(state.anchor)
        if fragment is not None:  # its leaves alone
            names = [n for n, f in zip(names, self.assignment, strict=True) if f == fragment]
        pushed = payload.encode(names, mean, self.codec, replicas)
        anchor = wire.named(self._anchor(state))  # the join's, should it be needed; read once
        start = time.monotonic()
        if self.plan.overlap and not last:  # Streaming DiLoCo's tau: it lands tau steps later
            self._inflight = self._sender.submit(self._exchange, fields, pushed, anchor)
            return state
        if not self.overlap:
            return self._land(state, self._exchange(fields, pushed, anchor), start)
        previous, self._inflight = self._inflight, self._sender.submit(
            self._exchange, fields, pushed, anchor)  # fmt: skip
        self.round += 1  # the next push is for the round after this one's
        if previous is None:  # the first: no answer to take yet
            self.last = {}
            state = self._take(state, None, anchor)
        else:
            state = self._land(state, previous.result(), start)
        if last:
            self.drain()
        return state

    def landing(self, step: int) -> bool:
        """Whether the answer of the push in flight lands after inner step ``step``: with
        ``streaming.overlap`` tau, tau steps after its sync (the simulator's landing)."""
        return bool(self.plan.overlap and self._inflight is not None
                    and self.plan.landing(step)[0])  # fmt: skip

    def land(self, state):
        """``state`` with the answer of the push in flight landed (:meth:`landing`): its
        fragment mixed in by ``streaming.mix``; the round's report in ``last``, its wait the
        time this call waited for the answer."""
        inflight, self._inflight = self._inflight, None
        assert inflight is not None
        start = time.monotonic()
        return self._land(state, inflight.result(), start)

    def drain(self) -> None:
        """Waits for the push on its way, if any (overlapped rounds), up to the client's
        timeout; a failure is said and not raised (the run's own state is whole)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        try:
            self.finished = self.finished or bool(inflight.result(self.client.timeout).reply.get(
                "finished"))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - said; the run ends with what it has
            self.log.warning("the last push was not answered: %s", e)

    def _exchange(self, fields: dict, pushed: dict, anchor: dict) -> Exchanged:
        """The push and the syncer's answer (a refused push: joined again; the same round is
        pushed again, a later one's anchor taken as it is). Safe in the sending thread. On the
        processes but the first, nothing: they receive process 0's answer (:meth:`_land`)."""
        counts: list = []
        sent = time.monotonic()
        if not self.lead:
            return Exchanged(fields, {}, {}, counts, 0.0, anchor)
        try:
            f, arrays, fields = self._push(fields, pushed, anchor, counts)
        except Exception as e:  # noqa: BLE001 - raised where the answer lands, on every process
            return Exchanged(fields, {}, {}, counts, time.monotonic() - sent, anchor, e)
        return Exchanged(fields, f, arrays, counts, time.monotonic() - sent, anchor)

    def _push(self, fields: dict, pushed: dict, anchor: dict, counts: list):
        """``(reply fields, anchor by name, fields as last sent)`` of a push (see
        :meth:`_exchange`)."""
        try:
            f, arrays = self._pushed(fields, pushed, counts)
        except service.RefusedBySyncer as e:
            base = fields["round"]
            self.log.warning("the syncer refused this learner's push (%s): joining again", e)
            arrays = self._join(anchor, counts)
            if self.round != base:  # the syncer moved on: this round's work is lost
                self.lost_rounds += 1
                self.log.warning("the syncer is at round %d: restarting from its anchor (the "
                                 "steps since round %d are in it only if that round closed with "
                                 "them)", self.round, base)  # fmt: skip
                return {"round": self.round, "restarted": True}, arrays, fields
            # the same round (a restarted syncer that does not know this learner): push again
            fields = {**fields, "generation": self.generation}
            f, arrays = self._pushed(fields, pushed, counts)
        return f, arrays, fields

    def _pushed(self, fields: dict, pushed: dict, counts: list) -> tuple[dict, dict]:
        """One push call and its answer's anchor, whole (with compress.answers: the round of
        the anchor held sent along, and an answer's change added to it, :mod:`.answers`)."""
        f, arrays = self.client.call("Push", {**fields, **self.held.asks()}, pushed,
                                     counts=counts)  # fmt: skip
        return f, self.held.took(f, arrays)

    def _land(self, state, got: Exchanged, start: float):
        """``state`` restarted from the answer's anchor (process 0's, on every process); the
        round's report in ``last``."""
        fragment = self.fragment(got.fields["round"])
        arrays = got.arrays
        if fragment is not None and not got.reply.get("restarted"):
            arrays = {**got.anchor, **arrays}  # the whole anchor's names: what the others expect
        f, arrays = self._from_lead(got.reply, arrays, got.anchor, got.error)
        if f.get("late"):
            self.log.info("this learner's push was %d round(s) late: merged into round %d",
                          f["late"], f["round"] - 1)  # fmt: skip
        # overlapped, one push is on its way: the next is for the round after its
        self.round = int(f["round"]) + (self._inflight is not None)
        self.finished = bool(f.get("finished"))
        if self.finished:
            self.log.info("the syncer has closed the run's last round (%d): this learner ends "
                          "with its anchor", f["round"])  # fmt: skip
        self.last = {"base_round": got.fields["round"], "round": int(f["round"]),
                     "late": int(f.get("late", 0)), "seconds_waited": time.monotonic() - start,
                     "seconds_in_flight": got.seconds,
                     "bytes_sent": sum(c[0] for c in got.counts),
                     "bytes_received": sum(c[1] for c in got.counts),
                     "restarted": bool(f.get("restarted"))}  # fmt: skip
        if f.get("restarted"):  # joined again: the answer is the syncer's anchor
            return self._restart(state, arrays)
        return self._take(state, arrays, fragment=fragment)

    def stopping(self) -> None:
        """The run is asked to stop (a signal, safe in its handler): from now on a call that
        cannot reach the syncer gives up after :data:`STOP_PATIENCE` seconds, not the client's
        whole patience (minutes), so that the run saves before whoever stopped it kills it."""
        self.client.patience = min(self.client.patience, STOP_PATIENCE)

    def close(self) -> None:
        self.drain()
        self._sender.shutdown(wait=False)
        self._stop.set()
        if not self.lead:
            self.client.close()
            return
        try:
            self.client.call("Leave", {"learner": self.learner, "generation": self.generation},
                             timeout=5.0)  # fmt: skip
        except (service.RefusedBySyncer, ConnectionError) as e:
            self.log.debug("leave: %s", e)
        self.client.close()


def connect(cfg, algorithm, flat_config: dict, log, *, mesh=None, replicas: int = 1,
            fsdp_specs=None) -> Learner:  # fmt: skip
    """The learner of a run with ``syncer.address``, not yet joined: its ``replicas`` on
    ``mesh`` (None: the simulator's layout); ``fsdp_specs``: where its state's leaves live
    with FSDP (:func:`diloco_jax.runtime.parallel.state_specs`)."""
    sy = cfg.syncer
    tls = credentials.tls_of(sy.credentials)
    clients = [service.Client(address.strip(), credentials.credential(sy), tls=tls,
                              timeout=sy.timeout * 4 + 60, credentials=sy.credentials)
               for address in sy.address.split(",")]  # fmt: skip
    codec, compressed = recipe.push_codec_of(cfg), cfg.compress.answers
    client: Any = clients[0]
    if sy.shards > 1:  # every call to every shard; each shard's answer rebuilt there
        client, compressed = fanout.Fanout(clients, codec, compressed), False
    rows = cfg.data.batch_size * algorithm.plan.period  # a round's (streaming: a fragment's)
    return Learner(client, algorithm, learner=sy.learner, keys=shared_keys(flat_config),
                   rows_per_round=rows, heartbeat=sy.heartbeat, log=log,
                   codec=codec, overlap=cfg.outer.mode == "delayed", mesh=mesh,
                   replicas=replicas, learners=sy.learners,
                   outer_scale=recipe.outer_lr_input(cfg), fsdp_specs=fsdp_specs,
                   compress_answers=compressed)  # fmt: skip


def _sync_parts(algorithm, mesh, learners: int, fsdp_specs=None, fragment: int | None = None):
    """``(contribute, restart, land_mean)``: the core's parts of a sync taken between calls,
    for the replicas of a run's layout. ``contribute(state) -> (state, mean, total_w)``, the
    mean and the weight once (every replica has them; with DCT momentum, in place of the
    mean, the replicas' messages: :meth:`~diloco_jax.algorithm.Diloco.messages`);
    ``restart(state, anchor) -> state``, the anchor placed on every device (``fragment``: a
    streaming fragment's alone, its leaves' mean, its anchor a list of its leaves);
    ``land_mean(state, mean, outer_scale) -> state``, the mean of ``learners`` learners.
    ``vmap`` over the replicas (the simulator) or, on ``mesh``, over each device's virtual
    replicas under ``shard_map`` over the devices, as the run's step; with ``fsdp_specs``
    each replica's state stays split over its ``DATA`` devices."""
    axes = state_lib.vmap_axes(algorithm.kinds)
    inner = REPLICA if mesh is None else LOCAL_REPLICA
    # DCT momentum, SparseLoCo: the replicas' own messages, which the syncer decodes
    part = algorithm.contribution if algorithm.exchange.messages is None else algorithm.messages
    contribute_R = jax.vmap(lambda s: part(s, fragment=fragment or 0),
                            in_axes=(axes,), out_axes=(axes, 0, 0), axis_name=inner)  # fmt: skip
    restart_R = jax.vmap(lambda s, a: algorithm.restart(s, a, fragment=fragment),
                         in_axes=(axes, None), out_axes=axes)  # fmt: skip
    land_R = jax.vmap(lambda s, mean, scale: algorithm.land_mean(s, mean, learners, scale),
                      in_axes=(axes, None, None), out_axes=axes, axis_name=inner)  # fmt: skip

    def contribute(state):
        state, mean_R, total_w_R = contribute_R(state)
        return state, jax.tree.map(lambda x: x[0], mean_R), total_w_R[0]

    if mesh is None:
        return jax.jit(contribute), jax.jit(restart_R), jax.jit(land_R)
    specs = state_lib.specs(algorithm.kinds)
    if fsdp_specs is None:
        return (parallel.mesh_map(contribute, mesh, (specs,), (specs, P(), P())),
                parallel.mesh_map(restart_R, mesh, (specs, P()), specs),
                parallel.mesh_map(land_R, mesh, (specs, P(), P()), specs))  # fmt: skip
    local = fsdp.local_specs(fsdp_specs)
    kept = lambda fn: lambda state, *a: fn(fsdp.constrain(state, local), *a)  # noqa: E731
    return (parallel.mesh_map(kept(contribute), mesh, (specs,), (specs, P(), P()),
                              placed=(fsdp_specs, P(), P())),
            parallel.mesh_map(kept(restart_R), mesh, (specs, P()), specs, placed=fsdp_specs),
            parallel.mesh_map(kept(land_R), mesh, (specs, P(), P()), specs,
                              placed=fsdp_specs))  # fmt: skip
