"""Who is calling the syncer: credentials derived from the run's secret, so that each learner
can act only as itself and the syncer keeps no list of them.

The syncer holds the run's secret (``secrets.token_urlsafe``; ``syncer.token_file``,
``$DILOCO_SERVE_TOKEN`` or the ``token`` of its ``syncer.credentials`` folder). Every other
party holds a credential derived from it with HMAC-SHA256:

* learner ``I``: ``learner.I.<hex of HMAC(secret, "diloco-jax learner I")>``;
* the operator (status page, ``/metrics``, control): ``operator.<hex of HMAC(secret,
  "diloco-jax operator")>``.

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


class Identity(NamedTuple):
    """A caller the syncer knows: ``kind`` ``"learner"`` (with its index, ``learner``) or
    ``"operator"`` (learner -1)."""

    kind: str
    learner: int = -1

    def __str__(self) -> str:
        return f"learner {self.learner}" if self.kind == LEARNER else self.kind


def _mac(secret: str, what: str) -> str:
    return hmac.new(secret.encode(), f"diloco-jax {what}".encode(), hashlib.sha256).hexdigest()


def learner_credential(secret: str, index: int) -> str:
    """Learner ``index``'s credential for the run whose secret is ``secret``."""
    return f"{LEARNER}.{index}.{_mac(secret, f'{LEARNER} {index}')}"


def operator_credential(secret: str) -> str:
    """The operator's credential (status, metrics, control) for the run's ``secret``."""
    return f"{OPERATOR}.{_mac(secret, OPERATOR)}"


def named_learner(credential: str) -> int | None:
    """The learner index a credential names (unverified), or None when it names none."""
    parts = credential.split(".")
    if len(parts) == 3 and parts[0] == LEARNER and parts[1].isdigit():
        return int(parts[1])
    return None


def identify(secret: str, credential: str) -> Identity | None:
    """The identity ``credential`` proves for the run's ``secret``, or None (wrong, forged,
    malformed or empty). Constant time in the credential's MAC."""
    if not secret or not credential:
        return None
    index = named_learner(credential)
    if index is not None:
        want, who = learner_credential(secret, index), Identity(LEARNER, index)
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


FREE_FAILURES = 3  # failed authentications a peer gets before its answers slow down
LOG_EVERY = 30.0  # seconds between two lines about one peer's failures


class Failures:
    """Failed authentications per peer address: counted, logged a line per peer at most every
    :data:`LOG_EVERY` seconds (with the count, and through ``event`` into the syncer's tape),
    answered later after :data:`FREE_FAILURES` (0.1 s, doubling, up to 2 s)."""

    def __init__(self, event: Callable[..., None]):
        self.event, self.lock = event, threading.Lock()
        self.count: dict[str, int] = {}
        self.logged: dict[str, float] = {}

    def delay(self, peer: str, why: str) -> float:
        """Counts one failure of ``peer``; returns the seconds to wait before answering."""
        with self.lock:
            n = self.count[peer] = self.count.get(peer, 0) + 1
            say = time.monotonic() - self.logged.get(peer, -LOG_EVERY) >= LOG_EVERY
            if say:
                self.logged[peer] = time.monotonic()
        if say:
            log.warning("syncer: %d failed authentication(s) from %s so far (%s)", n, peer, why)
            self.event("auth_failed", peer=peer, count=n, reason=why)
        return 0.0 if n <= FREE_FAILURES else min(0.05 * 2 ** (n - FREE_FAILURES), 2.0)


def address(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:1.2.3.4:5678``, ``ipv6:[::1]:5678``)."""
    where = peer.partition(":")[2]
    return where.rpartition(":")[0] or where
