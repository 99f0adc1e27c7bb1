"""The syncer over gRPC, and the learner's client of it.

gRPC (``grpcio``, the ``learners`` extra) with raw byte messages: every request and reply is a
:mod:`diloco_jax.learners.wire` message, its arrays streamed in chunks of at most
``wire.CHUNK`` bytes, each call under a deadline. Every call carries the token
(``authorization: Bearer TOKEN`` metadata); a wrong or missing one is ``UNAUTHENTICATED`` and
changes nothing. Methods of the service ``diloco_jax.Syncer``:

- ``Join`` (stream -> stream): learner index, parameters described, training keys, its anchor
  -> generation, round, the syncer's anchor.
- ``Push`` (stream -> stream): learner, generation, base round, weight, its mean
  pseudo-gradient -> the anchor after the round it is merged into (its own round, or for a
  late push in quorum rounds the open one), once that round has closed, and how many rounds
  late the push was.
- ``Heartbeat``, ``Leave`` (one message each way).

A refusal is ``FAILED_PRECONDITION`` with the syncer's one-line reason.
"""

from __future__ import annotations

import hmac
import logging
import random
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import numpy as np

from diloco_jax.base import extras
from diloco_jax.base.access import is_loopback
from diloco_jax.learners import wire
from diloco_jax.learners.syncer import Refused, Syncer

log = logging.getLogger("diloco_jax")
SERVICE = "diloco_jax.Syncer"


def _grpc():
    return extras.require("grpc", "learners and a syncer")


def _options(max_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", wire.CHUNK + wire.MAX_HEADER),
            ("grpc.max_send_message_length", wire.CHUNK + wire.MAX_HEADER)]  # fmt: skip


class Server:
    """``syncer`` served at ``host:port`` (0: a free port, see :attr:`port`)."""

    def __init__(self, syncer: Syncer, host: str, port: int, *, token: str,
                 max_bytes: int = 1 << 34, wait_timeout: float = 600.0):  # fmt: skip
        grpc = _grpc()
        if not token:
            raise ValueError("the syncer needs a token (syncer.token_file or $DILOCO_SERVE_TOKEN)")
        self.syncer, self.token, self.max_bytes = syncer, token, max_bytes
        self.wait_timeout = wait_timeout
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=64),
                                   options=_options(max_bytes))  # fmt: skip
        handlers = {
            "Join": grpc.stream_stream_rpc_method_handler(self._join),
            "Push": grpc.stream_stream_rpc_method_handler(self._push),
            "Heartbeat": grpc.stream_stream_rpc_method_handler(self._heartbeat),
            "Leave": grpc.stream_stream_rpc_method_handler(self._leave),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        where = host if ":" not in host else f"[{host}]"
        self.port = self._server.add_insecure_port(f"{where}:{port}")
        if not self.port:
            raise OSError(f"cannot listen on {host}:{port}")
        self.host = host
        if not is_loopback(host):
            log.warning("the syncer listens on %s: every learner needs the token", host)

    def start(self) -> Server:
        self._server.start()
        return self

    def stop(self, grace: float = 0.5) -> None:
        self._server.stop(grace).wait()

    # each handler: check the token, read the request, answer or refuse
    def _read(self, requests, context) -> tuple[dict, dict[str, np.ndarray]]:
        grpc = _grpc()
        given = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        try:
            fields, arrays = wire.decode(requests, self.max_bytes)
        except wire.WireError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"refused: {e}")
        self.syncer.bytes_in += sum(a.nbytes for a in arrays.values())
        return fields, arrays

    def _answer(self, fields: dict, arrays: dict | None = None) -> Iterator[bytes]:
        self.syncer.bytes_out += sum(a.nbytes for a in (arrays or {}).values())
        return wire.encode(fields, arrays)

    def _refusing(self, context, fn):
        try:
            return fn()
        except Refused as e:
            context.abort(_grpc().StatusCode.FAILED_PRECONDITION, str(e))

    def _join(self, requests, context):
        f, arrays = self._read(requests, context)
        generation, rnd, anchor = self._refusing(
            context, lambda: self.syncer.join(int(f["learner"]), f["describe"], f["keys"], arrays)
        )
        return self._answer({"generation": generation, "round": rnd,
                             "finished": self.syncer.finished}, anchor)  # fmt: skip

    def _push(self, requests, context):
        f, arrays = self._read(requests, context)
        learner, generation, base = int(f["learner"]), int(f["generation"]), int(f["round"])
        late = self._refusing(context, lambda: self.syncer.push(
            learner, generation, base, float(f["weight"]), arrays))  # fmt: skip
        joined = base + late  # the round this push is merged into: the answer follows it
        rnd, anchor = self.syncer.wait(joined, 0.0 if self.syncer.finished else self.wait_timeout)
        if rnd <= joined and not self.syncer.finished:
            context.abort(_grpc().StatusCode.DEADLINE_EXCEEDED,
                          f"round {joined} did not close in {self.wait_timeout:.0f}s")  # fmt: skip
        return self._answer({"round": rnd, "late": late, "finished": self.syncer.finished},
                            anchor)  # fmt: skip

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


class RefusedBySyncer(RuntimeError):
    """The syncer turned a request down (its reason is the message)."""


class SyncerUnreachable(ConnectionError):
    """The syncer could not be reached for the client's whole patience."""


class Client:
    """A learner's connection to the syncer at ``address`` (``HOST:PORT``). Calls retry with
    backoff while the syncer cannot be reached (saying so), up to ``patience`` seconds."""

    def __init__(self, address: str, token: str, *, timeout: float, patience: float = 300.0,
                 max_bytes: int = 1 << 34):  # fmt: skip
        grpc = _grpc()
        self.address, self.timeout, self.patience, self.max_bytes = (
            address, timeout, patience, max_bytes)  # fmt: skip
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._channel = grpc.insecure_channel(address, options=_options(max_bytes))
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
            chunks = list(wire.encode(fields, arrays))
            try:
                replies = self._calls[name](iter(chunks), metadata=self._metadata,
                                            timeout=timeout or self.timeout)  # fmt: skip
                got: list[int] = []
                out = wire.decode(_kept(replies, got), self.max_bytes)
                sent, received = sum(len(c) for c in chunks), sum(got)
                self.bytes_sent += sent
                self.bytes_received += received
                if counts is not None:
                    counts.append((sent, received))
                return out
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.UNAUTHENTICATED):  # fmt: skip
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


def _kept(chunks, sizes: list[int]) -> Iterator[bytes]:
    """``chunks``, noting each one's size in ``sizes``."""
    for chunk in chunks:
        sizes.append(len(chunk))
        yield chunk


def arrays_of(named: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in named.items()}
