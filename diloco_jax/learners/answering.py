"""How the syncer's status page (:mod:`.status`) answers one request whose head has been
read: who may read what, and the answer of each path.

* Public (with ``mutual``, on the operator's certificate): the page's files and ``/login``,
  the sign-in form, or with ``?once=TOKEN`` a one-time link's session (a spent, expired or
  unknown link refused and counted).
* ``POST /session``: a session (a cookie) for the operator's credential, given as the
  ``Authorization: Bearer`` header (the form's script sends it; a body is never read);
  ``POST /logout`` ends the cookie's session.
* The operator's alone (its credential as a Bearer header, exactly as before sessions, or a
  live session's cookie): ``/`` the page, ``/summary`` its summary, ``/status``, ``/history``,
  ``/metrics``. A browser that shows neither at ``/`` is sent to ``/login``; any other is
  refused (401; a browser's unknown cookie at ``/``: a redirect to ``/login``, the cookie
  cleared) and counted in the syncer's failed authentications (:class:`.identity.Failures`)."""

from __future__ import annotations

import io
import json
import logging
import socket
import ssl
import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import generate_latest

from diloco_jax.learners import identity, view
from diloco_jax.learners.sessions import Sessions, cookie_name, presented
from diloco_jax.learners.syncer import Syncer

log = logging.getLogger("diloco_jax")
# what every answer says: never cached; the page runs its own files alone, in no frame
HEADERS = (
    ("Cache-Control", "no-store"),
    ("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; "
     "img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
     "base-uri 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
)  # fmt: skip
JSON = "application/json"


def common_name(sock: socket.socket) -> str | None:
    """The common name of the client certificate ``sock``'s peer showed (None: no TLS or none)."""
    cert: Any = sock.getpeercert() if isinstance(sock, ssl.SSLSocket) else None
    names = [v for rdn in (cert or {}).get("subject", ()) for k, v in rdn if k == "commonName"]
    return names[0] if len(names) == 1 else None


def handler(syncer: Syncer, *, secret: str, mutual: bool, failures: identity.Failures,
            sessions: Sessions, port: int, secure: bool) -> type:  # fmt: skip
    """The class that answers one request of the page at ``port`` (``secure``: over TLS) as
    the module's docstring says; ``Handler(sock, peer, head)`` answers it."""
    cookie = cookie_name(port, secure)
    metrics, update = view.registry(syncer)

    class Handler(BaseHTTPRequestHandler):
        def version_string(self) -> str:  # no Python version for a prober
            return "diloco-jax"

        def __init__(self, sock: socket.socket, peer: str, head: bytes):  # no socket reads
            self.request = self.connection = sock
            self.client_address = (peer, 0)
            self.rfile, self.wfile = io.BytesIO(head), sock.makefile("wb")
            try:
                self.handle()
            finally:
                self.wfile.close()

        def log_message(self, format, *args):  # noqa: A002 - the base class's name
            log.debug("syncer status page: %s %s", self.client_address[0],
                      identity.printable(format % args))  # fmt: skip

        def _send(self, code: int, body: bytes, kind: str, *more: tuple[str, str]) -> None:
            self.send_response(code)
            for name, value in (("Content-Type", kind), ("Content-Length", str(len(body))),
                                *HEADERS, *more):  # fmt: skip
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def _redirect(self, where: str, *more: tuple[str, str]) -> None:
            self._send(303, b"", "text/plain", ("Location", where), *more)

        def _signed_in(self, where: str | None) -> None:
            """A new session's cookie, with a redirect to ``where`` (None: 204)."""
            session = ("Set-Cookie", sessions.set_cookie(cookie, sessions.open(), secure))
            if where is None:
                return self._send(204, b"", "text/plain", session)
            return self._redirect(where, session)

        def _certified(self) -> bool:
            return not mutual or common_name(self.connection) == identity.OPERATOR

        def operator(self, path: str, bearer: bool = False) -> bool:
            """Whether the request is the operator's: its credential as a Bearer header,
            else (unless ``bearer``) a live session's cookie; with ``mutual``, on the
            operator's certificate either way. If not, it is answered: a browser that shows
            neither at ``/`` is sent to ``/login``; anything else is refused and counted."""
            given = self.headers.get("Authorization")
            session = None if bearer else presented(self.headers.get("Cookie"), cookie)
            if given is None and session is None and path == "/" and self._certified():
                self._redirect("/login")
                return False
            if given is None and session is not None and sessions.valid(session):
                who: identity.Identity | None = identity.Identity(identity.OPERATOR)
            else:
                who = identity.identify(secret, (given or "").removeprefix("Bearer "))
            if mutual and common_name(self.connection) != identity.OPERATOR:
                who = None  # the operator's credential on another party's certificate
            if who is None or who.kind != identity.OPERATOR:
                failures.failed(self.client_address[0], "a wrong credential on the status page")
                self._refuse(browser=path == "/" and given is None)
                return False
            return True

        def _refuse(self, browser: bool) -> None:
            if browser:  # sent to sign in, its cookie (if any) cleared
                return self._redirect("/login", self._cleared())
            return self._send(401, b'{"error": "the operator\'s credential is needed"}', JSON)

        def _cleared(self) -> tuple[str, str]:
            return "Set-Cookie", sessions.set_cookie(cookie, "", secure)

        def public(self, path: str, query: str) -> None:
            """The page's files, the sign-in form, and a one-time link's sign-in (a spent,
            expired or forged one refused and counted)."""
            if path != "/login":
                return self._send(200, *view.asset(path))
            once = urllib.parse.parse_qs(query).get("once")
            if not once:
                return self._send(200, view.login_page(), view.HTML)
            if sessions.spend(once[0]):
                return self._signed_in("/")
            failures.failed(self.client_address[0], "a spent, expired or unknown link")
            note = "That link has been used, or has expired: sign in with the credential."
            return self._send(401, view.login_page(note), view.HTML)

        def do_GET(self):  # noqa: N802 - http.server's name
            path, _, query = self.path.partition("?")
            if path == "/favicon.ico":  # asked for unbidden by a browser: none, nothing counted
                return self._send(404, b"", "text/plain")
            if (path in view.ASSETS or path == "/login") and self._certified():
                return self.public(path, query)
            if not self.operator(path):
                return None
            if path == "/metrics":
                update()
                return self._send(200, generate_latest(metrics), "text/plain; version=0.0.4")
            if path == "/status":
                return self._send(200, json.dumps(update()).encode(), JSON)
            if path == "/history":
                rounds = {"rounds": syncer.past_rounds()}
                return self._send(200, json.dumps(rounds).encode(), JSON)
            if path == "/summary":
                return self._send(200, view.summary(update()).encode(), view.HTML)
            if path == "/":
                return self._send(200, view.page(update()), view.HTML)
            return self._send(404, b'{"error": "not found"}', JSON)

        def do_POST(self):  # noqa: N802 - http.server's name
            """``/session``: a session for the operator's credential (the header alone: a
            body is never read); ``/logout``: the cookie's session ended."""
            path = self.path.partition("?")[0]
            if path == "/session":
                if self.operator(path, bearer=True):
                    self._signed_in(None)
                return None
            if path == "/logout":
                sessions.close(presented(self.headers.get("Cookie"), cookie) or "")
                return self._redirect("/login", self._cleared())
            return self._send(404, b'{"error": "not found"}', JSON)

    return Handler
