"""Who may read the syncer's status page in a browser, which cannot send the operator's
credential as a header on its own: sessions and one-time links.

* A **session** is a random token (:func:`secrets.token_urlsafe`, 256 bits) in a cookie:
  ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page sends it),
  ``Path=/``, ``Max-Age`` :data:`SESSION_SECONDS`, and with TLS ``Secure`` under a
  ``__Host-`` name (never sent in clear, never set for another host). The page opens one for a
  request that carries the operator's credential (``POST /session``, which the sign-in form's
  script sends as ``Authorization: Bearer``), or for a one-time link.
* A **one-time link** (``/login?once=TOKEN``) opens a session once, within
  :data:`LINK_SECONDS` of being made: the syncer logs one as it starts, so whoever reads its
  log signs in with a click.

Both tables are bounded: at most :data:`MAX_SESSIONS` sessions and :data:`MAX_LINKS` links
live at once (one more evicts the oldest), and the expired ones are dropped as new ones are
made. A token is kept only as its SHA-256, compared with every live one in constant time
(:func:`hmac.compare_digest`): the time a lookup takes says nothing about a token's bytes.
Nothing is written to disk: a restarted syncer forgets its sessions (a browser signs in again).

A cookie names the page's port (:func:`cookie_name`): browsers send a host's cookies to each
of its ports, and the pages of two syncers on one host must not overwrite each other's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable

SESSION_SECONDS = 12 * 3600  # a session's life (the cookie's Max-Age)
LINK_SECONDS = 15 * 60  # a one-time link's life
MAX_SESSIONS = 64  # sessions live at once: a sign-in beyond evicts the oldest
MAX_LINKS = 16  # one-time links unspent at once
MAX_TOKEN = 128  # characters of a token worth looking up (ours have 43)


def _key(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "replace")).digest()


class _Table:
    """Tokens (by their SHA-256) with their expiry, oldest first, at most ``limit`` of them."""

    def __init__(self, limit: int, seconds: float, clock: Callable[[], float]):
        self.limit, self.seconds, self.clock = limit, seconds, clock
        self.expiry: dict[bytes, float] = {}

    def new(self) -> str:
        now = self.clock()
        self.expiry = {k: t for k, t in self.expiry.items() if t > now}
        while len(self.expiry) >= self.limit:
            del self.expiry[next(iter(self.expiry))]
        token = secrets.token_urlsafe(32)
        self.expiry[_key(token)] = now + self.seconds
        return token

    def find(self, token: str) -> bytes | None:
        """``token``'s key where it is live, else None (an expired one is dropped)."""
        if not token or len(token) > MAX_TOKEN:
            return None
        key = _key(token)
        # every key compared, in constant time: no early exit says how close a guess came
        found = [k for k in self.expiry if hmac.compare_digest(k, key)]
        if not found:
            return None
        if self.expiry[key] <= self.clock():
            del self.expiry[key]
            return None
        return key


class Sessions:
    """The page's sessions and one-time links (see the module's docstring), thread-safe;
    ``clock``: seconds, monotonic (a test's own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 session_seconds: float = SESSION_SECONDS, link_seconds: float = LINK_SECONDS,
                 max_sessions: int = MAX_SESSIONS, max_links: int = MAX_LINKS):  # fmt: skip
        self.session_seconds = session_seconds
        self._sessions = _Table(max_sessions, session_seconds, clock)
        self._links = _Table(max_links, link_seconds, clock)
        self._lock = threading.Lock()

    def open(self) -> str:
        """A new session's token (the cookie's value)."""
        with self._lock:
            return self._sessions.new()

    def link(self) -> str:
        """A new one-time link's token."""
        with self._lock:
            return self._links.new()

    def valid(self, token: str) -> bool:
        """Whether ``token`` is a live session's."""
        with self._lock:
            return self._sessions.find(token) is not None

    def spend(self, token: str) -> bool:
        """Whether ``token`` is a live one-time link's; it is spent either way."""
        with self._lock:
            key = self._links.find(token)
            if key is None:
                return False
            del self._links.expiry[key]
            return True

    def close(self, token: str) -> None:
        """Ends ``token``'s session (signing out), if it is one."""
        with self._lock:
            key = self._sessions.find(token)
            if key is not None:
                del self._sessions.expiry[key]

    def __len__(self) -> int:
        """The sessions held (expired ones included until the next sign-in drops them)."""
        with self._lock:
            return len(self._sessions.expiry)

    def set_cookie(self, name: str, token: str, secure: bool) -> str:
        """The ``Set-Cookie`` value of session ``token`` (empty: the cookie cleared)."""
        age = int(self.session_seconds) if token else 0
        flags = "; Secure" if secure else ""
        return f"{name}={token}; Max-Age={age}; Path=/; HttpOnly; SameSite=Strict{flags}"


def cookie_name(port: int, secure: bool) -> str:
    """The session cookie's name for the page at ``port`` (``__Host-``: with TLS, only ever set
    by this host, over HTTPS, for the whole path)."""
    return f"{'__Host-' if secure else ''}diloco_syncer_{port}"


def presented(header: str | None, name: str) -> str | None:
    """The value of the cookie ``name`` in a ``Cookie`` request header (None: no such cookie).
    Read by hand: :mod:`http.cookies` raises on a header another site's cookies can garble."""
    for part in (header or "").split(";"):
        key, eq, value = part.strip().partition("=")
        if eq and key == name:
            return value.strip().strip('"')
    return None
