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

import logging
import random
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import numpy as np

from diloco_jax.base import extras
from diloco_jax.base.access import is_loopback
from diloco_jax.learners import identity, intake, wire
from diloco_jax.learners.syncer import Refused, Syncer

log = logging.getLogger("diloco_jax")
SERVICE = "diloco_jax.Syncer"


def _grpc():
    return extras.require("grpc", "learners and a syncer")


def _options(max_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", wire.CHUNK + wire.MAX_HEADER),
            ("grpc.max_send_message_length", wire.CHUNK + wire.MAX_HEADER)]  # fmt: skip


def plaintext_refusal(host: str, what: str = "the syncer") -> str:
    return (f"{what} would listen on {host} without TLS: set syncer.credentials to the folder "
            "`diloco-syncer certs DIR` made for it (DIR/syncer), or syncer.insecure=true to send "
            "credentials and tensors in clear")  # fmt: skip


class Server:
    """``syncer`` served at ``host:port`` (0: a free port, see :attr:`port`). ``secret``: the
    run's secret (:mod:`.identity`); ``tls``: the syncer's :class:`~.certs.Tls` (None:
    plaintext, refused off loopback unless ``insecure``); ``mutual``: learners must show a
    certificate of the run's CA."""

    def __init__(self, syncer: Syncer, host: str, port: int, *, secret: str, tls=None,
                 mutual: bool = False, insecure: bool = False, max_bytes: int = 1 << 34,
                 wait_timeout: float = 600.0):  # fmt: skip
        grpc = _grpc()
        if not secret:
            raise ValueError("the syncer needs the run's secret (syncer.credentials, "
                             "syncer.token_file or $DILOCO_SERVE_TOKEN)")  # fmt: skip
        if tls is None and not is_loopback(host) and not insecure:
            raise ValueError(plaintext_refusal(host))
        if mutual and tls is None:
            raise ValueError("syncer.mutual_tls needs TLS: set syncer.credentials")
        self.syncer, self.secret, self.max_bytes = syncer, secret, max_bytes
        self.wait_timeout, self.mutual = wait_timeout, mutual
        self.failures = identity.Failures(syncer.event)
        self._first_join = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=64),
                                   options=_options(max_bytes))  # fmt: skip
        handlers = {name: grpc.stream_stream_rpc_method_handler(fn) for name, fn in (
            ("Join", self._join), ("Push", self._push), ("Heartbeat", self._heartbeat),
            ("Leave", self._leave))}  # fmt: skip
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        where = f"{host if ':' not in host else f'[{host}]'}:{port}"
        if tls is None:
            self.port = self._server.add_insecure_port(where)
        else:
            creds = grpc.ssl_server_credentials([(tls.key, tls.cert)],
                                                root_certificates=tls.ca if mutual else None,
                                                require_client_auth=mutual)  # fmt: skip
            self.port = self._server.add_secure_port(where, creds)
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port}")
        self.host, self.tls = host, tls is not None
        if tls is None and not is_loopback(host):
            log.warning("the syncer listens on %s WITHOUT TLS (syncer.insecure): credentials "
                        "and tensors travel in clear", host)  # fmt: skip

    def start(self) -> Server:
        self._server.start()
        return self

    def stop(self, grace: float = 0.5) -> None:
        self._server.stop(grace).wait()

    # each handler: who is calling, read the request, answer or refuse
    def _who(self, context) -> identity.Identity:
        """The caller's identity, from its call's metadata (before any message is read); aborts
        ``UNAUTHENTICATED`` (counted, slowed) for a wrong credential."""
        grpc = _grpc()
        given = dict(context.invocation_metadata()).get("authorization", "")
        who = identity.identify(self.secret, given.removeprefix("Bearer "))
        if who is not None and self.mutual:  # the certificate must name the same party
            names = context.auth_context().get("x509_common_name", [])
            want = f"learner-{who.learner}" if who.kind == identity.LEARNER else who.kind
            if [n.decode() for n in names] != [want]:
                who = None
        if who is None:
            peer = identity.address(context.peer())
            time.sleep(self.failures.delay(peer, "missing or wrong credential"))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong credential")
        assert who is not None
        return who

    def _as(self, who: identity.Identity, learner: int, context) -> None:
        """Aborts ``PERMISSION_DENIED`` unless ``who`` is learner ``learner`` itself."""
        grpc = _grpc()
        if who != identity.Identity(identity.LEARNER, learner):
            self.syncer.event("impersonation", caller=str(who), claimed=learner,
                              peer=identity.address(context.peer()))  # fmt: skip
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this credential is {who}'s: it cannot act as learner {learner}",
            )

    def _header(self, it, context, max_bytes: int | None = None) -> wire.Header:
        """The first message of a request, its size checked against ``max_bytes`` (default:
        the server's) before anything more is read."""
        try:
            return wire.read_header(it, self.max_bytes if max_bytes is None else max_bytes)
        except wire.WireError as e:
            context.abort(_grpc().StatusCode.INVALID_ARGUMENT, f"refused: {e}")
            raise

    def _read(self, requests, context, max_bytes: int = 0) -> tuple[dict, dict[str, np.ndarray]]:
        """A whole request of a learner, after its credential is checked: one of at most
        ``max_bytes`` of data (a heartbeat or a leave has none)."""
        header, it = self._opened(requests, context, max_bytes)
        return header.fields, self._data(it, header, context)

    def _opened(self, requests, context, max_bytes: int) -> tuple[wire.Header, Iterator[bytes]]:
        """A learner's request up to its header: the caller's credential, then the header's
        size (at most ``max_bytes``) and the learner it names."""
        who, it = self._who(context), iter(requests)
        header = self._header(it, context, max_bytes)
        self._as(who, _learner_of(header.fields, context), context)
        return header, it

    def _data(self, it, header: wire.Header, context) -> dict[str, np.ndarray]:
        data, at = bytearray(header.size), 0

        def write(chunk: bytes) -> None:
            nonlocal at
            data[at : at + len(chunk)] = chunk
            at += len(chunk)

        try:
            wire.read_data(it, header, write)
        except wire.WireError as e:
            context.abort(_grpc().StatusCode.INVALID_ARGUMENT, f"refused: {e}")
        self.syncer.bytes_in += header.size
        return wire.arrays_in(data, header.leaves)

    def _answer(self, fields: dict, arrays: dict | None = None,
                sha256: str | None = None) -> Iterator[bytes]:  # fmt: skip
        self.syncer.bytes_out += sum(a.nbytes for a in (arrays or {}).values())
        return wire.encode(fields, arrays, sha256)

    def _refusing(self, context, fn):
        try:
            return fn()
        except Refused as e:
            context.abort(_grpc().StatusCode.FAILED_PRECONDITION, str(e))

    def _join(self, requests, context):
        model = sum(a.nbytes for a in self.syncer.anchor or [])
        header, it = self._opened(requests, context, model or self.max_bytes)
        f, arrays = header.fields, {}
        if self.syncer.anchor is None:  # the first join brings the anchor; the others' are
            with self._first_join:  # not read (many joins at once would each hold a model)
                if self.syncer.anchor is None:
                    arrays = self._data(it, header, context)
        join = lambda: self.syncer.join(int(f["learner"]), f["describe"], f["keys"],  # noqa: E731
                                        arrays, f.get("fragments"))  # fmt: skip
        generation, rnd, anchor = self._refusing(context, join)
        return self._answer({"generation": generation, "round": rnd,
                             "finished": self.syncer.finished}, anchor)  # fmt: skip

    def _push(self, requests, context):
        who, it = self._who(context), iter(requests)
        header = self._header(it, context)
        f = header.fields
        learner = _learner_of(f, context)
        self._as(who, learner, context)
        try:
            generation, base, weight = int(f["generation"]), int(f["round"]), float(f["weight"])
            push_id = str(f["push"])[:64]
            holds = None if f.get("holds") is None else int(f["holds"])  # compress.answers
        except (KeyError, TypeError, ValueError):
            context.abort(_grpc().StatusCode.INVALID_ARGUMENT, "refused: a push without its "
                          "generation, round, weight and push id")  # fmt: skip
            raise
        sy = self.syncer
        ticket = self._refusing(context, lambda: sy.admit(learner, generation, base, push_id,
                                                          header.leaves))  # fmt: skip
        if ticket.kind == "again":  # a copy: answered with the first one's round, not merged
            settled = sy.settled(ticket, self.wait_timeout)
            ticket = (
                settled
                if settled is not None
                else self._refusing(
                    context, lambda: sy.admit(learner, generation, base, push_id, header.leaves)
                )
            )
        if ticket.kind == "new":
            late = self._receive(it, header, ticket, weight, context)
        else:
            late = 0 if ticket.joined is None else ticket.joined - ticket.base
        joined = base + late  # the round this push is merged into: the answer follows it
        rnd, anchor, sha, how = sy.reply(joined, 0.0 if sy.finished else self.wait_timeout,
                                         holds)  # fmt: skip
        if rnd <= joined and not sy.finished:
            context.abort(_grpc().StatusCode.DEADLINE_EXCEEDED,
                          f"round {joined} did not close in {self.wait_timeout:.0f}s")  # fmt: skip
        return self._answer({"round": rnd, "late": late, "finished": sy.finished,
                             "again": ticket.kind == "again", **how}, anchor, sha)  # fmt: skip

    def _receive(self, it, header: wire.Header, ticket, weight: float, context) -> int:
        """A new push's data, streamed to a file and entered into the open round; its lateness."""
        sy = self.syncer
        path = sy.incoming / f"{ticket.learner}-{ticket.id}"
        try:
            intake.receive(it, header, path)
            spilled = intake.spilled(sy._described(ticket.base), header, path, sy.codec)
        except wire.WireError as e:
            sy.release(ticket)
            context.abort(_grpc().StatusCode.INVALID_ARGUMENT, f"refused: {e}")
        except BaseException:  # the stream broke: its copy may come again
            sy.release(ticket)
            raise
        sy.bytes_in += header.size
        try:
            return sy.enter(ticket, weight, spilled, spilled.finite())
        except Refused as e:
            spilled.remove()
            context.abort(_grpc().StatusCode.FAILED_PRECONDITION, str(e))
            raise

    def _heartbeat(self, requests, context):
        f, _ = self._read(requests, context)
        rnd = self._refusing(
            context, lambda: self.syncer.heartbeat(int(f["learner"]), int(f["generation"]))
        )
        return self._answer({"round": rnd})

    def _leave(self, requests, context):
        f, _ = self._read(requests, context)
        self._refusing(context, lambda: self.syncer.leave(int(f["learner"]), int(f["generation"])))
        return self._answer({})


def _learner_of(fields: dict, context) -> int:
    try:
        return int(fields["learner"])
    except (KeyError, TypeError, ValueError):
        context.abort(_grpc().StatusCode.INVALID_ARGUMENT, "refused: a call without its learner")
        raise


class RefusedBySyncer(RuntimeError):
    """The syncer turned a request down (its reason is the message)."""


class SyncerUnreachable(ConnectionError):
    """The syncer could not be reached for the client's whole patience."""


class Client:
    """A learner's connection to the syncer at ``address`` (``HOST:PORT``). Calls retry with
    backoff while the syncer cannot be reached (saying so), up to ``patience`` seconds."""

    def __init__(self, address: str, credential: str, *, timeout: float, tls=None,
                 patience: float = 300.0, max_bytes: int = 1 << 34):  # fmt: skip
        grpc = _grpc()
        self.address, self.timeout, self.patience, self.max_bytes = (
            address, timeout, patience, max_bytes)  # fmt: skip
        self._metadata = (("authorization", f"Bearer {credential}"),)
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=_options(max_bytes))
        else:  # the syncer is verified against the run's CA; our certificate, if we have one
            creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
            self._channel = grpc.secure_channel(address, creds, options=_options(max_bytes))
        self._calls = {name: self._channel.stream_stream(f"/{SERVICE}/{name}")
                       for name in ("Join", "Push", "Heartbeat", "Leave")}  # fmt: skip
        self.bytes_sent = self.bytes_received = 0  # on the wire: headers, arrays, framing

    def call(self, name: str, fields: dict, arrays: dict | None = None,
             timeout: float | None = None, counts: list | None = None,
             ) -> tuple[dict, dict[str, np.ndarray]]:  # fmt: skip
        """One request; returns the reply's ``(fields, arrays)`` (and appends ``(bytes sent,
        bytes received)`` to ``counts``). Raises :class:`RefusedBySyncer` for a refusal,
        ``SyncerUnreachable`` when the syncer stays unreachable for ``patience`` seconds."""
        grpc = _grpc()
        start, delay = time.monotonic(), 0.2
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
                    raise RefusedBySyncer(f"{name}: {e.details()}") from None
                # unreachable, or the syncer stopped while answering: try again
                again = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                if not again or time.monotonic() - start > self.patience:
                    raise SyncerUnreachable(f"syncer {self.address}: {name} failed: "
                                          f"{code.name}: {e.details()}") from None  # fmt: skip
                log.warning("the syncer at %s cannot be reached (%s); retrying in %.1fs",
                            self.address, e.details(), delay)  # fmt: skip
                time.sleep(delay * (1 + 0.2 * random.random()))
                delay = min(delay * 2, 5.0)

    def close(self) -> None:
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
