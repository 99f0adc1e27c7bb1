"""The syncer over gRPC, and the learner's client of it.

gRPC (``grpcio``, the ``learners`` extra) with raw byte messages: every request and reply is a
:mod:`diloco_jax.learners.wire` message, its arrays streamed in chunks of at most
``wire.CHUNK`` bytes, each call under a deadline.

- **Encryption**: with the syncer's certificate and key (``syncer.credentials``), the channel is
  TLS and the learners verify the syncer against the run's CA; with ``mutual`` each learner
  shows its own certificate too, and its name must be the one its credential claims. Off
  loopback the server refuses to start without TLS unless told ``insecure``.
- **Identity**: every call carries a credential (``authorization: Bearer CREDENTIAL``), checked
  against the run's secret (:mod:`.identity`): a learner's lets it act as itself only (a call
  naming another learner is ``PERMISSION_DENIED`` and changes nothing). A wrong or missing one
  is ``UNAUTHENTICATED``; failures are counted per peer, logged a line per peer with the count,
  and answered more slowly after :data:`.identity.FREE_FAILURES`.
- **A push** is checked before its data is read: its header (leaf names, shapes, dtypes and
  so its size) against the joined anchor and codec, its id against the pushes already in
  (exactly once: a copy is answered with its round's result). Its data then streams to a file
  (:mod:`.intake`), never whole in memory.

Methods of the service ``diloco_jax.Syncer``:

- ``Join`` (stream -> stream): learner index, parameters described, training keys, its anchor
  -> generation, round, the syncer's anchor.
- ``Push`` (stream -> stream): learner, generation, base round, weight, push id, its mean
  pseudo-gradient -> the anchor after the round it is merged into (its own round, or for a
  late push in quorum rounds the open one), once that round has closed, and how many rounds
  late the push was; with ``compress.answers`` (the push's ``holds``: the round whose anchor
  its learner holds) the anchor's change since, encoded, or the learners' anchor whole
  (:mod:`.answers`).
- ``Heartbeat``, ``Leave`` (one message each way).

A refusal is ``FAILED_PRECONDITION`` with the syncer's one-line reason.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import numpy as np

from diloco_jax.base import extras
from diloco_jax.base.access import is_loopback
from diloco_jax.learners import guard, identity, intake, unreachable, wire
from diloco_jax.learners.syncer import Refused, Syncer

log = logging.getLogger("diloco_jax")
SERVICE = "diloco_jax.Syncer"


def _grpc():
    # gRPC's C core at INFO writes a line per failed TLS handshake: a flood of them would be a
    # flood of the log (set GRPC_VERBOSITY to see them); its errors still come through
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    return extras.require("grpc", "learners and a syncer")


def _taken(host: str, port: int) -> bool:
    """Whether ``host:port`` is already listened on (checked with a plain socket, so that a
    port taken is said in our one line, not in gRPC's C core's)."""
    if not port:
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _options(max_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", wire.CHUNK + wire.MAX_HEADER),
            ("grpc.max_send_message_length", wire.CHUNK + wire.MAX_HEADER)]  # fmt: skip


def plaintext_refusal(host: str, what: str = "the syncer") -> str:
    return (f"{what} would listen on {host} without TLS: set syncer.credentials to the folder "
            "`diloco-syncer certs DIR` made for it (DIR/syncer), or syncer.insecure=true to send "
            "credentials and tensors in clear")  # fmt: skip


class Abort(Exception):
    """A call refused: ``code`` (a ``grpc.StatusCode`` name) and the one-line ``details``."""

    def __init__(self, code: str, details: str):
        super().__init__(details)
        self.code, self.details = code, details


DECISION_WAIT = 20.0  # seconds a Decision call waits for its round to close, then answers null


class Server:
    """``syncer`` served at ``host:port`` (0: a free port, see :attr:`port`). ``secret``: the
    run's secret (:mod:`.identity`); ``tls``: the syncer's :class:`~.certs.Tls` (None:
    plaintext, refused off loopback unless ``insecure``); ``mutual``: learners must show a
    certificate of the run's CA. ``idle``: seconds a call may go without a message before it
    is cancelled (:mod:`.guard`). ``shards``: the run's syncer shards (``syncer.shards``; the
    deciding one answers the others' ``Decision`` calls). One process per port: a port
    already taken is refused."""

    def __init__(self, syncer: Syncer, host: str, port: int, *, secret: str, tls=None,
                 mutual: bool = False, insecure: bool = False, max_bytes: int = 1 << 34,
                 wait_timeout: float = 600.0, idle: float = guard.IDLE,
                 shards: int = 1):  # fmt: skip
        grpc = _grpc()
        if not secret:
            raise ValueError("the syncer needs the run's secret (syncer.credentials, "
                             "syncer.token_file or $DILOCO_SERVE_TOKEN)")  # fmt: skip
        if tls is None and not is_loopback(host) and not insecure:
            raise ValueError(plaintext_refusal(host))
        if mutual and tls is None:
            raise ValueError("syncer.mutual_tls needs TLS: set syncer.credentials")
        self.syncer, self.secret, self.max_bytes = syncer, secret, max_bytes
        self.wait_timeout, self.mutual, self.shards = wait_timeout, mutual, shards
        self.failures = identity.Failures(syncer.event)
        self.lanes, self.watchdog = guard.Lanes(), guard.Watchdog(idle)
        self.errors = 0  # calls that ended in an error of the syncer's own (logged)
        self.follower: Any = None  # a shard but 0: its thread asking shard 0's decisions
        self.decision_wait = DECISION_WAIT
        pool = futures.ThreadPoolExecutor(self.lanes.workers(syncer.learners, shards),
                                          thread_name_prefix="served")  # fmt: skip
        self._server = grpc.server(pool, options=_options(max_bytes) + [("grpc.so_reuseport", 0)])
        methods = (("Join", self._join), ("Push", self._push), ("Heartbeat", self._heartbeat),
                   ("Leave", self._leave), ("Decision", self._decision))  # fmt: skip
        handlers = {name: grpc.stream_stream_rpc_method_handler(self._served(name, fn))
                    for name, fn in methods}  # fmt: skip
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        where = f"{host if ':' not in host else f'[{host}]'}:{port}"
        try:
            if _taken(host, port):
                raise RuntimeError(where)
            if tls is None:
                self.port = self._server.add_insecure_port(where)
            else:
                creds = grpc.ssl_server_credentials([(tls.key, tls.cert)],
                                                    root_certificates=tls.ca if mutual else None,
                                                    require_client_auth=mutual)  # fmt: skip
                self.port = self._server.add_secure_port(where, creds)
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise OSError(f"cannot listen on {where}: the port is taken (another syncer?) or "
                          "the address is not this host's (syncer.address)")  # fmt: skip
        self.host, self.tls = host, tls is not None
        if tls is None and not is_loopback(host):
            log.warning("the syncer listens on %s WITHOUT TLS (syncer.insecure): credentials "
                        "and tensors travel in clear", host)  # fmt: skip

    def start(self) -> Server:
        self._server.start()
        return self

    def stop(self, grace: float = 0.5) -> None:
        if self.follower is not None:
            self.follower.stop()
        self._server.stop(grace).wait()
        self.watchdog.stop()

    # every call: who is calling (before any message is read), a lane of its own, a watchdog
    def _served(self, method: str, fn):
        def handler(requests, context):
            grpc = _grpc()
            try:
                who = self._who(context)
                if not self.lanes.enter(who, method):
                    raise Abort("RESOURCE_EXHAUSTED", f"{who} has {self.lanes.limits[method]} "
                                f"{method} call(s) in flight already")  # fmt: skip
                watched = self.watchdog.watch(context.cancel)

                def over() -> None:
                    self.watchdog.forget(watched)
                    self.lanes.leave(who, method)

                if not context.add_callback(over):  # the call has already ended
                    over()
                return watched.replies(fn(watched.requests(requests), context, who, watched))
            except Abort as e:
                context.abort(getattr(grpc.StatusCode, e.code), e.details)
            except grpc.RpcError:
                raise  # the call was cancelled or broke: gRPC ends it without a word
            except Exception as e:  # noqa: BLE001 - one line, the call refused; never a page
                self.errors += 1
                log.error("syncer: a %s call failed: %s: %s", method, type(e).__name__,
                          identity.printable(str(e)), exc_info=self.errors <= 3)  # fmt: skip
                context.abort(grpc.StatusCode.INTERNAL, f"the syncer failed: {type(e).__name__}")

        return handler

    def _who(self, context) -> identity.Identity:
        """The caller's identity, from its call's metadata (refused ``UNAUTHENTICATED`` at
        once, and counted, for a wrong credential; the operator's is refused as any learner's
        once its header names one)."""
        given = dict(context.invocation_metadata()).get("authorization", "")
        who = identity.identify(self.secret, given.removeprefix("Bearer "))
        if who is not None and self.mutual:  # the certificate must name the same party
            names = context.auth_context().get("x509_common_name", [])
            want = who.kind if who.kind == identity.OPERATOR else f"{who.kind}-{who.learner}"
            if [n.decode() for n in names] != [want]:
                who = None
        if who is None:
            self.failures.failed(identity.address(context.peer()), "missing or wrong credential")
            raise Abort("UNAUTHENTICATED", "missing or wrong credential")
        return who

    def _as(self, who: identity.Identity, learner: int, context) -> None:
        """Refuses ``PERMISSION_DENIED`` unless ``who`` is learner ``learner`` itself."""
        if who != identity.Identity(identity.LEARNER, learner):
            self.syncer.event("impersonation", caller=str(who), claimed=learner,
                              peer=identity.address(context.peer()))  # fmt: skip
            raise Abort(
                "PERMISSION_DENIED",
                f"this credential is {who}'s: it cannot act as learner {learner}",
            )

    def _opened(self, requests, context, who, max_bytes: int = 0,
                ) -> tuple[wire.Header, Iterator[bytes]]:  # fmt: skip
        """A learner's request up to its header: its size (at most ``max_bytes``; default: the
        server's) and the learner it names, which must be the caller."""
        it = iter(requests)
        try:
            header = wire.read_header(it, max_bytes or self.max_bytes)
        except wire.WireError as e:
            raise Abort("INVALID_ARGUMENT", f"refused: {e}") from None
        self._as(who, _learner_of(header.fields), context)
        return header, it

    def _answer(self, fields: dict, arrays: dict | None = None,
                sha256: str | None = None) -> Iterator[bytes]:  # fmt: skip
        self.syncer.bytes_out += sum(a.nbytes for a in (arrays or {}).values())
        return wire.encode(fields, arrays, sha256)

    def _join(self, requests, context, who, watched):
        header, it = self._opened(requests, context, who)
        try:
            described, keys, fragments, capacity = guard.join_fields(header.fields)
        except guard.BadField as e:
            raise Abort("INVALID_ARGUMENT", f"refused: a join whose {e}") from None
        learner, sy, arrays = who.learner, self.syncer, {}
        if sy.anchor is None:  # the first join brings the anchor: to a file, as pushes come
            arrays = self._first_anchor(it, header, described)  # (a join that is not the
        # first is not read: the syncer's description is compared instead, naming a leaf)
        join = lambda: sy.join(learner, described, keys, arrays, fragments,  # noqa: E731
                               capacity=capacity)  # fmt: skip
        with watched.waiting():  # a join may wait for the open round to close
            generation, rnd, anchor = _refusing(join)
        return self._answer({"generation": generation, "round": rnd,
                             "finished": self.syncer.finished}, anchor)  # fmt: skip

    def _first_anchor(self, it, header: wire.Header, described: list) -> dict[str, np.ndarray]:
        """The first join's anchor, streamed to a file (its size grows only as its bytes come)
        once its arrays are the model its join describes, then read back."""
        problem = wire.first_mismatch(described, header.leaves)
        if problem:
            raise Abort("INVALID_ARGUMENT", f"refused: a join whose arrays are not the model it "
                        f"describes: {problem}")  # fmt: skip
        path = self.syncer.incoming / f"join-{uuid.uuid4().hex}"
        try:
            intake.receive(it, header, path)
        except wire.WireError as e:
            raise Abort("INVALID_ARGUMENT", f"refused: {e}") from None
        self.syncer.bytes_in += header.size
        try:
            spilled = intake.spilled(described, header, path, None)
            return {name: x for (name, _, _), x in zip(described, spilled.leaves(), strict=True)}
        finally:
            path.unlink(missing_ok=True)

    def _push(self, requests, context, who, watched):
        header, it = self._opened(requests, context, who)
        try:
            generation, base, weight, push_id, holds = guard.push_fields(header.fields)
            loss, finite = guard.push_loss(header.fields), guard.push_finite(header.fields)
        except guard.BadField as e:
            raise Abort("INVALID_ARGUMENT", f"refused: a push whose {e}") from None
        sy, learner, alive = self.syncer, int(header.fields["learner"]), context.is_active
        admit = lambda: sy.admit(learner, generation, base, push_id, header.leaves,  # noqa: E731
                                 weight=weight, loss=loss)  # fmt: skip
        ticket = _refusing(admit)
        if ticket.kind == "again":  # a copy: answered with the first one's round, not merged
            with watched.waiting():
                settled = sy.settled(ticket, self.wait_timeout, alive)
            ticket = settled if settled is not None else _refusing(admit)
        if ticket.kind == "new":
            late = self._receive(it, header, ticket, weight, finite)
        else:
            late = 0 if ticket.joined is None else ticket.joined - ticket.base
        joined = base + late  # the round this push is merged into: the answer follows it
        with watched.waiting():
            rnd, anchor, sha, how = sy.reply(joined, 0.0 if sy.finished else self.wait_timeout,
                                             holds, alive)  # fmt: skip
        if rnd <= joined and not sy.finished:
            raise Abort("DEADLINE_EXCEEDED", f"round {joined} did not close in "
                        f"{self.wait_timeout:.0f}s")  # fmt: skip
        return self._answer({"round": rnd, "late": late, "finished": sy.finished,
                             "again": ticket.kind == "again", **how}, anchor, sha)  # fmt: skip

    def _receive(self, it, header: wire.Header, ticket, weight: float,
                 finite: bool | None = None) -> int:  # fmt: skip
        """A new push's data, streamed to a file and entered into the open round; its lateness
        (``finite``: whether the learner's whole mean is, said to a syncer shard)."""
        sy = self.syncer
        path = sy.incoming / f"{ticket.learner}-{ticket.id}"
        try:
            intake.receive(it, header, path)
            spilled = intake.spilled(sy._described(ticket.base), header, path, sy.codec)
        except wire.WireError as e:
            sy.release(ticket)
            raise Abort("INVALID_ARGUMENT", f"refused: {e}") from None
        except BaseException:  # the stream broke: its copy may come again
            sy.release(ticket)
            raise
        sy.bytes_in += header.size
        try:
            return sy.enter(ticket, weight, spilled, spilled.finite(), finite)
        except Refused as e:
            spilled.remove()
            raise Abort("FAILED_PRECONDITION", str(e)) from None

    def _heartbeat(self, requests, context, who, watched):
        generation = self._small(requests, context, who)
        rnd = _refusing(lambda: self.syncer.heartbeat(who.learner, generation))
        return self._answer({"round": rnd})

    def _leave(self, requests, context, who, watched):
        generation = self._small(requests, context, who)
        _refusing(lambda: self.syncer.leave(who.learner, generation))
        return self._answer({})

    def _decision(self, requests, context, who, watched):
        """A following syncer shard asks how round ``round`` closed: answered once the
        deciding shard (this one) has closed it (``decision``: :class:`~.rounds.Decision`
        as JSON), or with ``decision`` null after a while of waiting (it asks again)."""
        if who.kind != identity.SHARD or not 0 < who.learner < self.shards:
            raise Abort("PERMISSION_DENIED", f"{who} cannot ask how rounds closed: syncer "
                        f"shards 1 to {self.shards - 1} only")  # fmt: skip
        try:
            rnd = guard.integer(wire.read_header(iter(requests), 1).fields, "round")
        except (wire.WireError, guard.BadField) as e:
            raise Abort("INVALID_ARGUMENT", f"refused: {e}") from None
        with watched.waiting():
            decision = _refusing(lambda: self.syncer.decided(rnd, self.decision_wait,
                                                             context.is_active))  # fmt: skip
        return self._answer(
            {
                "round": self.syncer.round,
                "decision": None if decision is None else decision.to_json(),
            }
        )

    def _small(self, requests, context, who) -> int:
        """The generation a heartbeat or a leave (no data) names."""
        header, _ = self._opened(requests, context, who, max_bytes=1)
        try:
            return guard.integer(header.fields, "generation")
        except guard.BadField as e:
            raise Abort("INVALID_ARGUMENT", f"refused: {e}") from None


def _refusing(fn):
    try:
        return fn()
    except Refused as e:
        raise Abort("FAILED_PRECONDITION", str(e)) from None


def _learner_of(fields: dict) -> int:
    try:
        return guard.integer(fields, "learner", 0, 1 << 20)
    except guard.BadField:
        raise Abort("INVALID_ARGUMENT", "refused: a call without its learner") from None


class RefusedBySyncer(RuntimeError):
    """The syncer turned a request down (its reason is the message)."""


class SyncerUnreachable(ConnectionError):
    """The syncer could not be reached: for the client's whole patience, or at all (a
    misconfiguration, :mod:`.unreachable`). Its message is one line: the cause and the fix."""


HOPELESS_TRIES = 3  # a misconfiguration is tried this many times, then given up


class Client:
    """A learner's connection to the syncer at ``address`` (``HOST:PORT``). Calls retry with
    backoff while the syncer cannot be reached (saying why in words, :mod:`.unreachable`), up
    to ``patience`` seconds; a misconfiguration that no retry can mend (the syncer's certificate
    without this address's name or of another CA, a peer that is not a TLS gRPC server) is given
    up after :data:`HOPELESS_TRIES` tries. ``credentials``: the folder ``tls`` was read from,
    named in those errors."""

    def __init__(self, address: str, credential: str, *, timeout: float, tls=None,
                 patience: float = 300.0, max_bytes: int = 1 << 34,
                 credentials: str = ""):  # fmt: skip
        grpc = _grpc()
        self.address, self.timeout, self.patience, self.max_bytes = (
            address, timeout, patience, max_bytes)  # fmt: skip
        self._tls, self._credentials = tls is not None, credentials
        self._metadata = (("authorization", f"Bearer {credential}"),)
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=_options(max_bytes))
        else:  # the syncer is verified against the run's CA; our certificate, if we have one
            creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
            self._channel = grpc.secure_channel(address, creds, options=_options(max_bytes))
        self._calls = {name: self._channel.stream_stream(f"/{SERVICE}/{name}")
                       for name in ("Join", "Push", "Heartbeat", "Leave",
                                    "Decision")}  # fmt: skip
        self.bytes_sent = self.bytes_received = 0  # on the wire: headers, arrays, framing
        self.label = ""  # what its lines say first (``syncer shard K: ``, among shards)
        self._closed = False

    def call(self, name: str, fields: dict, arrays: dict | None = None,
             timeout: float | None = None, counts: list | None = None,
             ) -> tuple[dict, dict[str, np.ndarray]]:  # fmt: skip
        """One request; returns the reply's ``(fields, arrays)`` (and appends ``(bytes sent,
        bytes received)`` to ``counts``). Raises :class:`RefusedBySyncer` for a refusal,
        :class:`SyncerUnreachable` when the syncer stays unreachable for ``patience`` seconds
        or cannot be reached as configured."""
        grpc = _grpc()
        start, delay, hopeless = time.monotonic(), 0.2, 0
        while True:
            put: list[int] = []  # encoded as it is sent, again at each try: never held whole
            try:
                replies = self._calls[name](_kept(wire.encode(fields, arrays), put),
                                            metadata=self._metadata,
                                            timeout=timeout or self.timeout)  # fmt: skip
                got: list[int] = []
                out = wire.decode(_kept(replies, got), self.max_bytes)
                sent, received = sum(put), sum(got)
                self.bytes_sent += sent
                self.bytes_received += received
                if counts is not None:
                    counts.append((sent, received))
                return out
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.PERMISSION_DENIED):  # fmt: skip
                    raise RefusedBySyncer(f"{self.label}{name}: {e.details()}") from None
                if self._closed:  # closed under the call (its owner is stopping)
                    raise SyncerUnreachable(f"{self.label}the client of {self.address} was "
                                            "closed") from None  # fmt: skip
                # unreachable, or the syncer stopped while answering: try again
                # (or its lanes of this call are taken: a try before this one is still ending)
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                grpc.StatusCode.RESOURCE_EXHAUSTED):  # fmt: skip
                    said = f"{code.name}: {e.details()}"
                    raise SyncerUnreachable(f"{self.label}syncer {self.address}: {name} "
                                            f"failed: {said}") from None  # fmt: skip
                why = unreachable.cause(e.details() or "", self.address, tls=self._tls,
                                        credentials=self._credentials)  # fmt: skip
                hopeless += not why.transient
                spent = time.monotonic() - start
                if hopeless >= HOPELESS_TRIES or spent > self.patience:
                    waited = f" for {spent:.0f}s" if why.transient else ""
                    raise SyncerUnreachable(f"{self.label}{why.what}{waited}: {why.fix}") from None
                log.warning("%s%s; retrying in %.1fs", self.label, why.what, delay)
                time.sleep(delay * (1 + 0.2 * random.random()))
                delay = min(delay * 2, 5.0)

    def close(self) -> None:
        self._closed = True
        self._channel.close()


def tune_malloc(arenas: int = 2, mapped: int = wire.CHUNK) -> None:
    """glibc's malloc for a server of many threads and 1 MiB messages: at most ``arenas``
    arenas (each thread would get its own), and blocks of ``mapped`` bytes or more mapped and
    unmapped, never kept in an arena (glibc's moving threshold otherwise keeps the chunks of
    every stream that was ever open). Measured on the syncer (scripts/bench_syncer.py): its
    memory no longer grows with its learners. Best effort: nothing where the C library is not
    glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-8, arenas)  # M_ARENA_MAX
        libc.mallopt(-3, mapped)  # M_MMAP_THRESHOLD (fixed: no longer raised by frees)
    except (OSError, AttributeError):
        pass


def _kept(chunks, sizes: list[int]) -> Iterator[bytes]:
    """``chunks``, noting each one's size in ``sizes``."""
    for chunk in chunks:
        sizes.append(len(chunk))
        yield chunk


def arrays_of(named: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in named.items()}
