"""Who is calling the syncer: credentials derived from the run's secret, so that each learner
can act only as itself and the syncer keeps no list of them.

The syncer holds the run's secret (``secrets.token_urlsafe``; ``syncer.token_file``,
``$DILOCO_SERVE_TOKEN`` or the ``token`` of its ``syncer.credentials`` folder). Every other
party holds a credential derived from it with HMAC-SHA256:

* learner ``I``: ``learner.I.<hex of HMAC(secret, "diloco-jax learner I")>``;
* the operator (status page, ``/metrics``, control): ``operator.<hex of HMAC(secret,
  "diloco-jax operator")>``;
* syncer shard ``K`` (``syncer.shards``, issue 62), asking shard 0 how each round closed:
  ``shard.K.<hex of HMAC(secret, "diloco-jax shard K")>`` (a shard holds the secret: it makes
  its own).

The syncer recomputes the HMAC of the identity a credential names and compares it in constant
time (:func:`identify`); a learner's credential says nothing about the secret or another
learner's. The secret itself is not a credential on the wire: whoever holds it makes them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger("diloco_jax")
OPERATOR = "operator"
LEARNER = "learner"
SHARD = "shard"


class Identity(NamedTuple):
    """A caller the syncer knows: ``kind`` ``"learner"`` or ``"shard"`` (with its index,
    ``learner``) or ``"operator"`` (learner -1)."""

    kind: str
    learner: int = -1

    def __str__(self) -> str:
        return self.kind if self.kind == OPERATOR else f"{self.kind} {self.learner}"


def _mac(secret: str, what: str) -> str:
    return hmac.new(secret.encode(), f"diloco-jax {what}".encode(), hashlib.sha256).hexdigest()


def learner_credential(secret: str, index: int) -> str:
    """Learner ``index``'s credential for the run whose secret is ``secret``."""
    return f"{LEARNER}.{index}.{_mac(secret, f'{LEARNER} {index}')}"


def operator_credential(secret: str) -> str:
    """The operator's credential (status, metrics, control) for the run's ``secret``."""
    return f"{OPERATOR}.{_mac(secret, OPERATOR)}"


def shard_credential(secret: str, index: int) -> str:
    """Syncer shard ``index``'s credential for the run whose secret is ``secret``."""
    return f"{SHARD}.{index}.{_mac(secret, f'{SHARD} {index}')}"


def _indexed(credential: str, kind: str) -> int | None:
    parts = credential.split(".")
    index = parts[1] if len(parts) == 3 and parts[0] == kind else ""
    if index.isascii() and index.isdigit() and len(index) < 10:
        return int(index)
    return None


def named_learner(credential: str) -> int | None:
    """The learner index a credential names (unverified), or None when it names none."""
    return _indexed(credential, LEARNER)


def identify(secret: str, credential: str) -> Identity | None:
    """The identity ``credential`` proves for the run's ``secret``, or None (wrong, forged,
    malformed or empty). Constant time in the credential's MAC."""
    if not secret or not credential:
        return None
    index, shard = named_learner(credential), _indexed(credential, SHARD)
    if index is not None:
        want, who = learner_credential(secret, index), Identity(LEARNER, index)
    elif shard is not None:
        want, who = shard_credential(secret, shard), Identity(SHARD, shard)
    elif credential.startswith(OPERATOR + "."):
        want, who = operator_credential(secret), Identity(OPERATOR)
    else:
        return None
    return who if hmac.compare_digest(credential.encode(), want.encode()) else None


def for_learner(token: str, index: int) -> str:
    """The credential learner ``index`` presents, given the ``token`` it was configured with:
    its own credential as it is, or the run's secret (a single-operator cluster that hands
    every host the secret), from which it derives its own. Raises ``ValueError`` for another
    learner's credential."""
    named = named_learner(token)
    if named is None:
        return learner_credential(token, index)
    if named != index:
        raise ValueError(f"the credential given is learner {named}'s, but this is learner "
                         f"{index} (syncer.learner)")  # fmt: skip
    return token


LOG_EVERY = 30.0  # seconds of the log's budget for failure lines (:data:`LOG_LINES` in each)
LOG_LINES = 20  # failure lines at most in any LOG_EVERY seconds, all peers together
PEERS = 4096  # peers whose failures are counted (the oldest forgotten first)


class Failures:
    """Failed authentications per peer address, counted, never waited on: a wrong credential
    is refused at once (a served call never sleeps on behalf of its caller: a sleeping worker
    is one the next caller does not get). Guessing gains nothing from the speed: a credential
    is a 256-bit HMAC (:func:`learner_credential`), so a guess succeeds with chance 2^-256.

    Logged without flooding: a line when a peer's count reaches 1, 2, 4, 8, ... (its count in
    it, and through ``event`` into the syncer's tape), at most :data:`LOG_LINES` lines in any
    :data:`LOG_EVERY` seconds for all peers together (the next line says how many were left
    out). At most :data:`PEERS` peers are remembered (an IPv6 flood has many addresses)."""

    def __init__(self, event: Callable[..., None], clock: Callable[[], float] = time.monotonic):
        self.event, self.clock, self.lock = event, clock, threading.Lock()
        self.count: dict[str, int] = {}
        self.total = self.unsaid = 0
        self._said: list[float] = []  # when the last lines were written

    def failed(self, peer: str, why: str) -> int:
        """Counts one failure of ``peer`` (logging it where due); returns the peer's count."""
        with self.lock:
            n = self.count.pop(peer, 0) + 1
            self.count[peer] = n  # the newest last: the oldest is forgotten first
            if len(self.count) > PEERS:
                del self.count[next(iter(self.count))]
            self.total += 1
            now = self.clock()
            self._said = [t for t in self._said if now - t < LOG_EVERY]
            due = n & (n - 1) == 0  # 1, 2, 4, 8, ...
            say = due and len(self._said) < LOG_LINES
            unsaid = self.unsaid
            if say:
                self._said.append(now)
                self.unsaid = 0
            elif due:
                self.unsaid += 1
        if say:
            more = f"; {unsaid} line(s) about other failures left out" if unsaid else ""
            log.warning("syncer: %d failed authentication(s) from %s so far (%s)%s", n,
                        printable(peer), why, more)  # fmt: skip
            self.event("auth_failed", peer=peer, count=n, reason=why, total=self.total)
        return n


def printable(text: str, limit: int = 200) -> str:
    """``text`` as a log line may hold it: control characters escaped (a caller's newline
    cannot forge a line), at most ``limit`` characters."""
    text = str(text)
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return text.encode("unicode_escape").decode("ascii")


def address(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``)."""
    where = peer.partition(":")[2]
    return where.rpartition(":")[0] or where
