"""The syncer's status page under abuse (issue 60, findings 5, 9 and 10 for the page), tried as
an attacker would: hundreds of idle connections (and, beyond the cap, a flood from one address),
handshakes that never finish, a flood of wrong credentials, a request without the client
certificate mutual TLS asks for, plain HTTP on the HTTPS port, a request trickled line by line
and one with 90 KB of headers. Each fails on the page of old: a thread per connection held
forever, failures neither counted nor logged, any client certificate or none, a traceback on
stderr per plain-HTTP request."""

import json
import logging
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest

from diloco_jax.learners import certs, identity
from diloco_jax.learners.status import StatusServer
from tests.test_learners import _algorithm, _syncer
from tests.test_syncer_security import _credentials, _tape

SECRET = "s"
# the page's idle timeout in these tests, and the operator's (shorter) patience: an answer
# within OPERATOR seconds cannot have waited for the attackers' connections to expire
TIMEOUT, OPERATOR = 3.0, 1.5


@pytest.fixture
def served(tmp_path):
    """A function that starts a status page (``secret``, StatusServer's keywords) over a
    syncer of one learner; every page it started is stopped at the end."""
    syncer, pages = _syncer(tmp_path, _algorithm(), learners=1), []

    def serve(secret=SECRET, **kw):
        pages.append(StatusServer(syncer, "127.0.0.1", 0, secret=secret, **kw).start())
        return pages[-1]

    yield serve
    for page in pages:
        page.stop()
    syncer.close()


def _get(page, secret=SECRET, context=None, credential=None, timeout=OPERATOR) -> dict:
    """``/status`` as the operator asks for it (``context``: over HTTPS with it)."""
    scheme = "http" if context is None else "https"
    credential = identity.operator_credential(secret) if credential is None else credential
    request = urllib.request.Request(f"{scheme}://127.0.0.1:{page.port}/status",
                                     headers={"Authorization": f"Bearer {credential}"})  # fmt: skip
    with urllib.request.urlopen(request, context=context, timeout=timeout) as r:
        return json.loads(r.read())


def _tls(tmp_path, party=None):
    """``(syncer's Tls, secret, client context trusting the run's CA)``; ``party``: a folder
    whose client certificate the context shows."""
    folder, secret = _credentials(tmp_path, 1)
    context = ssl.create_default_context(cafile=str(folder / "operator" / "ca.pem"))
    if party is not None:
        context.load_cert_chain(folder / party / "cert.pem", folder / party / "key.pem")
    return certs.read(folder / "syncer"), secret, context


def _closed_by_server(socks, within: float) -> bool:
    """Whether the server closed every one of ``socks`` within ``within`` seconds."""
    deadline = time.monotonic() + within
    for s in socks:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if s.recv(1024) != b"":
                return False
        except ConnectionResetError:
            continue
        except TimeoutError:
            return False
    return True


def _reply(port: int, data: bytes, every: float = 0.0) -> bytes:
    """What the page answers to ``data`` sent raw (line by line, ``every`` seconds apart, when
    given), until it closes; b"" when it resets the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT + 5) as s:
        try:
            for line in data.splitlines(keepends=True) if every else [data]:
                s.sendall(line)
                time.sleep(every)
            return b"".join(iter(lambda: s.recv(65536), b""))
        except ConnectionError:
            return b""


def _open(port: int, count: int, send: bytes = b"") -> list[socket.socket]:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    for s in socks:
        s.sendall(send)
    return socks


def test_idle_connections_hold_no_thread_and_are_closed_while_the_operator_gets_in(served):
    """Finding 5: 1000 idle connections held 1029 threads and, at the open-file limit, locked
    out learners and the page. 200 connections that send nothing: a few threads at most, the
    operator answered while they are open, and every one closed by the server by its timeout."""
    page = served(timeout=TIMEOUT)
    before = threading.active_count()
    idle = _open(page.port, 200)
    try:
        time.sleep(0.5)  # the server has accepted them (a thread each, of old)
        assert threading.active_count() - before < 10
        assert _get(page)["round"] == 0
        assert _closed_by_server(idle, within=TIMEOUT + 3)
    finally:
        for s in idle:
            s.close()


def test_a_flood_from_one_address_evicts_its_own_connections_not_the_operators(served):
    """Finding 5 at the cap: with room for 4 connections, an attacker at 127.0.0.2 opens 4 idle
    ones, the operator opens one and, before it has sent its request, the attacker opens 20
    more. Each new one evicts the attacker's oldest (at once, not after the timeout); the
    operator's request is then answered."""
    page = served(max_open=4, timeout=TIMEOUT)

    def attacker(n: int) -> list[socket.socket]:
        try:
            return [socket.create_connection(("127.0.0.1", page.port),
                                             source_address=("127.0.0.2", 0))
                    for _ in range(n)]  # fmt: skip
        except OSError:
            pytest.skip("this host has no second loopback address (127.0.0.2)")

    flood = attacker(4)
    operator = socket.create_connection(("127.0.0.1", page.port), timeout=TIMEOUT + 5)
    flood += attacker(20)
    try:
        assert _closed_by_server(flood[:21], within=OPERATOR)
        operator.sendall(f"GET /status HTTP/1.0\r\nAuthorization: Bearer "
                         f"{identity.operator_credential(SECRET)}\r\n\r\n".encode())  # fmt: skip
        assert b"".join(iter(lambda: operator.recv(65536), b"")).startswith(b"HTTP/1.0 200")
    finally:
        for s in [operator, *flood]:
            s.close()


def test_a_client_that_never_finishes_its_tls_handshake_delays_no_one(tmp_path, served):
    """Finding 5 over TLS: 20 clients that connect and never send a ClientHello, 20 that stop
    after a record's first bytes. They hold no thread, do not delay the operator's HTTPS
    request, and are closed by the server by its timeout."""
    tls, secret, context = _tls(tmp_path)
    page = served(secret, tls=tls, timeout=TIMEOUT)
    before = threading.active_count()
    stalled = _open(page.port, 20) + _open(page.port, 20, send=b"\x16\x03\x01\x02")
    try:
        time.sleep(0.5)
        assert threading.active_count() - before < 10
        assert _get(page, secret, context)["round"] == 0
        assert _closed_by_server(stalled, within=TIMEOUT + 3)
    finally:
        for s in stalled:
            s.close()


def test_wrong_credentials_are_counted_refused_at_once_and_logged_in_few_lines(
    tmp_path, served, caplog
):
    """Finding 9 for the page: 300 wrong credentials were neither logged nor counted. Each is
    answered 401 at once; the syncer's tape counts them (``auth_failed`` at 1, 2, 4, ..., 256)
    and the log holds those 9 counted lines, not 300."""
    page = served()
    codes = []
    with caplog.at_level(logging.INFO, "diloco_jax"):
        for i in range(300):
            with pytest.raises(urllib.error.HTTPError) as refused:
                _get(page, credential=f"operator.{i:064x}")
            codes.append(refused.value.code)
    assert codes == [401] * 300
    counts = [e["count"] for e in _tape(tmp_path) if e["event"] == "auth_failed"]
    assert counts == [2**k for k in range(9)]
    lines = [r for r in caplog.records if "failed authentication" in r.getMessage()]
    assert len(lines) == 9
    assert _get(page)["round"] == 0  # the operator is not locked out by its address's failures


def test_under_mutual_tls_the_page_needs_the_operators_certificate_too(tmp_path, served):
    """Finding 10 for the page: it asked for no client certificate. With ``mutual``, the
    operator's credential without a certificate is refused at the handshake, and with a
    learner's certificate it is refused 401; with the operator's own, it is answered."""
    tls, secret, bare = _tls(tmp_path)
    page = served(secret, tls=tls, mutual=True)
    assert _get(page, secret, _tls(tmp_path, "operator")[2])["round"] == 0
    with pytest.raises(OSError) as refused:
        _get(page, secret, bare)
    why = refused.value
    why = why.reason if isinstance(why, urllib.error.URLError) else why  # urllib may wrap it
    assert isinstance(why, ssl.SSLError | ConnectionError)  # no HTTP answer, and no timeout
    with pytest.raises(urllib.error.HTTPError, match="401"):
        _get(page, secret, _tls(tmp_path, "learner_0")[2])


def test_plain_http_and_torn_handshakes_on_the_https_page_leave_no_traceback(
    tmp_path, served, capfd, caplog
):
    """Finding 10: a plain-HTTP request to the HTTPS page wrote a 20-line SSL traceback into the
    syncer's stderr. Plain HTTP is refused (400 in clear, saying the port speaks HTTPS); a
    garbled handshake and a client that leaves at once are closed; no traceback anywhere, and
    the operator is answered after them."""
    tls, secret, context = _tls(tmp_path)
    page = served(secret, tls=tls)
    ask = (f"GET /status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
           f"{identity.operator_credential(secret)}\r\n\r\n").encode()  # fmt: skip
    with caplog.at_level(logging.DEBUG, "diloco_jax"):
        plain = _reply(page.port, ask)
        assert not _reply(page.port, b"\x16\x03\x01\x00\x05hello" + ask).startswith(b"HTTP")
        socket.create_connection(("127.0.0.1", page.port)).close()
        assert _get(page, secret, context)["round"] == 0
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err + caplog.text
    assert not [r for r in caplog.records if r.exc_info]
    assert plain.startswith(b"HTTP/1.0 400") and b"HTTPS" in plain


def test_a_trickled_or_oversized_request_is_cut_off(served):
    """Slowloris: a request sent a header line every 0.3 s (each read well within any idle
    timeout) is closed once its ``timeout`` from the accept is spent, unanswered; a request of
    90 KB of headers (under http.server's own limits: 90 lines of 1 KB) is refused 431, or
    reset, before it is parsed, even with the operator's credential."""
    page = served(timeout=1.0)
    head = f"GET /status HTTP/1.1\r\nAuthorization: Bearer {identity.operator_credential(SECRET)}"
    head += "\r\n"
    trickled = head + "".join(f"X-{i}: {i}\r\n" for i in range(20)) + "\r\n"
    assert _reply(page.port, trickled.encode(), every=0.3) == b""  # cut at 1 s of its 6
    big = head + "".join(f"X-{i}: {'a' * 1000}\r\n" for i in range(90)) + "\r\n"
    reply = _reply(page.port, big.encode())
    assert reply == b"" or reply.startswith(b"HTTP/1.0 431")
