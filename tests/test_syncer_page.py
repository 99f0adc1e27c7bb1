"""The syncer's status page in a browser (issue 61, item 4): a sign-in a browser can do (the
operator's credential sent once by the sign-in form's script, for a session cookie; a one-time
link the syncer logs), with the Bearer header working as before; forged cookies, spent or
expired links counted as wrong credentials; the session table bounded; the learners' training
losses carried by their pushes (a loss that is not a finite number in range refused); and the
page in a real headless browser (Debian's chromium, as the run dashboard's test): opened by a
one-time link, its table rows and its charts' points those of the syncer."""

from __future__ import annotations

import json
import logging
import math
import re
import urllib.error
import urllib.request

import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax.algorithm import init_replicas
from diloco_jax.learners import guard, identity, keeping, service, sessions, wire
from diloco_jax.learners.status import StatusServer
from diloco_jax.learners.syncer import Refused
from tests.test_dashboard import BROWSER, headless
from tests.test_learners import _algorithm, _learner_fns, _syncer
from tests.test_status_abuse import _tls
from tests.test_syncer_security import _tape

SECRET = "page-secret"
KEYS = {"outer.sync_every": 3}
X = {"w": np.zeros(3, np.float32)}


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a 303 is read as it is, not followed


def _ask(page, path, *, method="GET", credential=None, cookie=None, context=None):
    """``(status, headers, body)`` of one request to ``page`` (``context``: over HTTPS), with
    the operator's ``credential`` as a Bearer header and ``cookie`` (``name=value``), if
    given; redirects not followed."""
    scheme = "http" if context is None else "https"
    headers = {} if credential is None else {"Authorization": f"Bearer {credential}"}
    if cookie is not None:
        headers["Cookie"] = cookie
    request = urllib.request.Request(f"{scheme}://127.0.0.1:{page.port}{path}", method=method,
                                     headers=headers)  # fmt: skip
    opener = urllib.request.build_opener(_NoRedirect, urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(request, timeout=5) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _session(headers) -> tuple[str, list[str]]:
    """``(name=value, attributes)`` of the ``Set-Cookie`` of an answer's ``headers``."""
    pair, *attributes = [part.strip() for part in headers["Set-Cookie"].split(";")]
    return pair, attributes


@pytest.fixture
def served(tmp_path):
    """A function that starts a status page (StatusServer's keywords; ``learners``: the
    syncer's) over a syncer of its own; ``(syncer, page)``. Stopped at the end."""
    made = []

    def serve(learners=2, secret=SECRET, clock=None, **kw):
        extra = {} if clock is None else {"clock": clock}
        syncer = _syncer(tmp_path / f"s{len(made)}", _algorithm(), learners=learners, **extra)
        page = StatusServer(syncer, "127.0.0.1", 0, secret=secret, **kw).start()
        made.append((syncer, page))
        return syncer, page

    yield serve
    for syncer, page in made:
        page.stop()
        syncer.close()


def _rounds(syncer, count: int, losses, clock=None, start: int = 0) -> None:
    """Every learner joined, then ``count`` rounds of pushes: learner ``i`` in round ``r``
    with the loss ``losses(i, r)`` (None: its push says none), its round open ``r + 1``
    seconds on ``clock``, ``1000 (r + 1)`` bytes in and ``10 (r + 1)`` out counted."""
    for i in range(syncer.learners):
        if i not in syncer.members:
            syncer.join(i, wire.describe(X), KEYS, wire.named(X))
    for r in range(start, start + count):
        syncer.bytes_in += 1000 * (r + 1)
        syncer.bytes_out += 10 * (r + 1)
        for i in range(syncer.learners):
            if clock is not None and i == syncer.learners - 1:
                clock.t += r + 1
            mean = {"['w']": np.full(3, 0.1 * (i + 1), np.float32)}
            syncer.push(i, syncer.members[i].generation, r, 1.0, mean, loss=losses(i, r))
        syncer.tick()  # the close, off the lock, settled
    assert syncer.round == start + count


# ---- signing in ----------------------------------------------------------------------------


def test_bearer_reads_as_before_and_a_browser_is_sent_to_sign_in(served):
    """The operator's credential as a Bearer header reads every path, as before sessions; a
    browser with nothing is sent from ``/`` to ``/login`` (not counted: it is no wrong
    credential); ``/status`` without one stays a 401 for scripts, counted. Every answer says
    ``no-store`` and a policy that lets the page run only its own files."""
    syncer, page = served()
    _rounds(syncer, 1, lambda i, r: 2.0 + i)
    operator = identity.operator_credential(SECRET)
    for path in ("/", "/status", "/history", "/summary", "/metrics"):
        assert _ask(page, path, credential=operator)[0] == 200, path
    code, headers, body = _ask(page, "/")
    assert (code, headers["Location"]) == (303, "/login")
    assert _ask(page, "/favicon.ico")[0] == 404  # what a browser asks for unbidden
    assert page.failures.total == 0
    code, headers, body = _ask(page, "/login")
    assert code == 200 and b'id="signin"' in body and b"login.js" in body
    assert headers["Cache-Control"] == "no-store"
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    for path in ("/status", "/history", "/metrics", "/summary"):
        code, _, body = _ask(page, path)
        assert code == 401 and json.loads(body)["error"], path
    assert page.failures.total == 4
    code, _, body = _ask(page, "/status", credential=identity.learner_credential(SECRET, 0))
    assert code == 401 and page.failures.total == 5  # a learner's credential, as before
    assert _ask(page, "/", credential="operator.wrong")[0] == 401  # a script's: no redirect


def test_signing_in_with_the_credential_sets_a_cookie_that_reads_the_page(served):
    """``POST /session`` with the operator's credential as the header (what the sign-in form's
    script sends) answers a session cookie: HttpOnly, SameSite=Strict, Path=/, 12 h, not
    Secure in clear. The cookie then reads ``/``, ``/status`` and ``/history``; a wrong
    credential gets no cookie and is counted; signing out ends the session."""
    syncer, page = served()
    _rounds(syncer, 1, lambda i, r: 2.0 + i)
    code, headers, _ = _ask(page, "/session", method="POST", credential="operator.wrong")
    assert code == 401 and "Set-Cookie" not in headers and page.failures.total == 1
    code, headers, _ = _ask(page, "/session", method="POST",
                            credential=identity.operator_credential(SECRET))  # fmt: skip
    assert code == 204
    cookie, attributes = _session(headers)
    assert cookie.startswith(f"diloco_syncer_{page.port}=")
    assert set(attributes) == {"Max-Age=43200", "Path=/", "HttpOnly", "SameSite=Strict"}
    code, _, body = _ask(page, "/", cookie=cookie)
    assert code == 200 and b'<table id="learners">' in body and b"<td>present</td>" in body
    assert json.loads(_ask(page, "/status", cookie=cookie)[2])["round"] == 1
    assert json.loads(_ask(page, "/history", cookie=cookie)[2])["rounds"][0]["round"] == 0
    code, headers, _ = _ask(page, "/logout", method="POST", cookie=cookie)
    assert code == 303 and headers["Location"] == "/login" and "Max-Age=0" in headers["Set-Cookie"]
    assert _ask(page, "/status", cookie=cookie)[0] == 401
    assert page.failures.total == 2


def test_a_one_time_link_signs_in_once_and_not_after_it_expires(served):
    """A one-time link sets a session cookie and sends the browser to ``/``; the same link a
    second time is refused (401, the sign-in form saying why) and counted, as is a forged
    one, and one opened after its 15 minutes (on the sessions' own clock)."""
    clock = _Clock()
    syncer, page = served(sessions=sessions.Sessions(clock))
    link = page.link("")  # the path of the link the syncer logs
    assert link.startswith("/login?once=")
    code, headers, _ = _ask(page, link)
    assert (code, headers["Location"]) == (303, "/")
    cookie, _ = _session(headers)
    assert _ask(page, "/status", cookie=cookie)[0] == 200
    code, headers, body = _ask(page, link)
    assert code == 401 and "Set-Cookie" not in headers and b"has been used" in body
    assert _ask(page, "/login?once=" + "A" * 43)[0] == 401
    late = page.link("")
    clock.t += sessions.LINK_SECONDS + 1
    assert _ask(page, late)[0] == 401
    assert page.failures.total == 3
    fresh = page.link("")
    clock.t += sessions.LINK_SECONDS - 1
    assert _ask(page, fresh)[0] == 303


def test_a_forged_or_expired_cookie_is_refused_and_counted(served, tmp_path):
    """A cookie the page did not give (forged, or of a session past its 12 hours) reads
    nothing: 401 at ``/status``, at ``/`` a redirect to sign in with the cookie cleared, each
    counted as a wrong credential, in the syncer's tape."""
    clock = _Clock()
    syncer, page = served(sessions=sessions.Sessions(clock))
    name = sessions.cookie_name(page.port, secure=False)
    code, _, _ = _ask(page, "/status", cookie=f"{name}=forged; other=1")
    assert code == 401
    code, headers, _ = _ask(page, "/", cookie=f"{name}=forged")
    assert (code, headers["Location"]) == (303, "/login") and "Max-Age=0" in headers["Set-Cookie"]
    cookie, _ = _session(_ask(page, page.link(""))[1])
    assert _ask(page, "/status", cookie=cookie)[0] == 200
    clock.t += sessions.SESSION_SECONDS + 1
    assert _ask(page, "/status", cookie=cookie)[0] == 401
    assert page.failures.total == 3
    tape = _tape(tmp_path / "s0")
    assert [e["count"] for e in tape if e["event"] == "auth_failed"] == [1, 2]  # 1, 2, 4, ...


def test_the_session_table_stays_bounded_under_a_flood_of_sign_ins(served):
    """200 sign-ins with the operator's credential hold at most 64 sessions: the newest reads
    the page, the oldest was evicted."""
    syncer, page = served()
    operator = identity.operator_credential(SECRET)
    cookies = [_session(_ask(page, "/session", method="POST", credential=operator)[1])[0]
               for _ in range(200)]  # fmt: skip
    assert len(page.sessions) == sessions.MAX_SESSIONS
    assert _ask(page, "/status", cookie=cookies[-1])[0] == 200
    assert _ask(page, "/status", cookie=cookies[-sessions.MAX_SESSIONS])[0] == 200
    assert _ask(page, "/status", cookie=cookies[0])[0] == 401


def test_over_tls_the_cookie_is_secure_and_mutual_tls_still_needs_the_operators_certificate(
    tmp_path, served
):
    """Over HTTPS the cookie is ``Secure`` and ``__Host-``; with mutual TLS a one-time link or a
    cookie on a learner's certificate is refused and counted (the link not spent), and on the
    operator's it signs in. Plain HTTP on the HTTPS port is still a 400 in clear."""
    tls, secret, _ = _tls(tmp_path)
    learner, operator = _tls(tmp_path, "learner_0")[2], _tls(tmp_path, "operator")[2]
    syncer, page = served(secret=secret, tls=tls, mutual=True)
    link = page.link("")
    assert _ask(page, link, context=learner)[0] == 401
    code, headers, _ = _ask(page, link, context=operator)
    assert code == 303
    cookie, attributes = _session(headers)
    assert cookie.startswith(f"__Host-diloco_syncer_{page.port}=") and "Secure" in attributes
    assert _ask(page, "/status", cookie=cookie, context=operator)[0] == 200
    assert _ask(page, "/status", cookie=cookie, context=learner)[0] == 401
    assert page.failures.total == 2
    code, _, body = _ask(page, "/login")  # plain HTTP on the HTTPS port
    assert code == 400 and b"HTTPS" in body


def test_the_syncer_logs_its_pages_address_and_a_link_and_the_launcher_says_where(
    tmp_path, monkeypatch, caplog, capsys
):
    """``diloco-syncer`` with ``syncer.status_port`` logs the page's address and a one-time
    link that signs a browser in; the local launcher, given the port, says the page's address
    and where the link and the credential are (and nothing without one)."""
    from diloco_jax.learners import command
    from diloco_jax.run.local_learners import LocalLearners, free_port
    from tests.test_launch_learners import _opts
    from tests.test_learners import _tiny

    monkeypatch.setenv("DILOCO_SERVE_TOKEN", SECRET)
    port = free_port()
    cfg = _tiny(**{"syncer.address": f"127.0.0.1:{free_port()}", "syncer.status_port": port})
    with caplog.at_level(logging.INFO, "diloco_jax"):
        server, page = command.serve(cfg, tmp_path / "syncer")
    try:
        said = next(r.getMessage() for r in caplog.records if "status page" in r.getMessage())
        assert said.startswith(f"syncer status page: http://127.0.0.1:{port}/ (in a browser")
        link = re.search(r"open this link once within 15 min: (\S+);", said).group(1)
        code, headers, _ = _ask(page, link.removeprefix(f"http://127.0.0.1:{port}"))
        assert (code, headers["Location"]) == (303, "/")
    finally:
        server.stop()
        page.stop()
        server.syncer.close()
    assert command.page_address("::1", 8, tls=True) == "https://[::1]:8"
    rest = ["--config", "tiny", "--config.syncer.status_port", str(port)]
    group = LocalLearners(_opts(), tmp_path / "launch", rest)
    group.say_page()
    operator = tmp_path / "launch" / "credentials" / "operator"
    err = capsys.readouterr().err
    assert f"the syncer's status page: https://127.0.0.1:{port}/ " in err
    assert "one-time link in the syncer's log" in err and f"{operator}/token" in err
    LocalLearners(_opts(), tmp_path / "quiet", ["--config", "tiny"]).say_page()
    assert capsys.readouterr().err == ""


# ---- the losses ----------------------------------------------------------------------------


def test_a_push_whose_loss_is_not_a_finite_number_in_range_is_refused(served, tmp_path):
    """A push saying a training loss of NaN, +-Inf or 1e300 is refused, naming the loss, in the
    tape, and counted on its learner; nothing enters the round. A push with a loss in range
    shows it on ``/status``, in the round's history and in the tape; a header's loss that is
    not a number is refused at the header (:func:`guard.push_loss`)."""
    syncer, page = served(learners=1)
    syncer.join(0, wire.describe(X), KEYS, wire.named(X))
    mean = {"['w']": np.ones(3, np.float32)}
    for bad in (math.nan, math.inf, -math.inf, 1e300):
        with pytest.raises(Refused, match=r"its training loss .* is not a finite number within "
                           r"1e\+12 of 0"):  # fmt: skip
            syncer.push(0, 1, 0, 1.0, mean, loss=bad)
    assert syncer.pending == {} and syncer.round == 0 and syncer.members[0].refused == 4
    syncer.push(0, 1, 0, 1.0, mean, loss=-2.5)  # a loss may be negative (a log-likelihood's)
    syncer.tick()
    status = json.loads(_ask(page, "/status", credential=identity.operator_credential(SECRET))[2])
    assert status["members"]["0"]["loss"] == -2.5 and status["refused"] == 4
    assert syncer.past_rounds()[0]["losses"] == {"0": -2.5}
    tape = _tape(tmp_path / "s0")
    assert [e["loss"] for e in tape if e["event"] == "refused"] == ["nan", "inf", "-inf", "1e+300"]
    assert [e["loss"] for e in tape if e["event"] == "pushed"] == [-2.5]
    assert guard.push_loss({}) is None and guard.push_loss({"loss": 3}) == 3.0
    assert guard.push_loss({"loss": 10**400}) == math.inf  # then refused by the syncer
    for bad in ("2.5", True, [1.0]):
        with pytest.raises(guard.BadField, match="loss must be a number"):
            guard.push_loss({"loss": bad})


def test_a_learner_pushes_its_rounds_mean_loss_and_a_bad_one_is_refused_over_grpc(tmp_path):
    """A learner's push carries the mean of the finite training losses its loop observed since
    its last sync; one beyond the syncer's range it leaves out (its push merged all the same).
    Over gRPC, a push of NaN loss is refused naming it, and one whose loss is text is refused
    at its header."""
    from diloco_jax.learners.learner import Learner

    algorithm, x0 = _algorithm(), jnp.zeros(3, jnp.float32)
    _, _, local = _learner_fns(algorithm)
    syncer = _syncer(tmp_path, algorithm, learners=1)
    server = service.Server(syncer, "127.0.0.1", 0, secret=SECRET).start()
    client = service.Client(f"127.0.0.1:{server.port}", identity.learner_credential(SECRET, 0),
                            timeout=30.0)  # fmt: skip
    learner = Learner(client, algorithm, learner=0, keys=KEYS, rows_per_round=3,
                      heartbeat=10.0, log=logging.getLogger("test"))  # fmt: skip
    target = np.array([[1.0, -2.0, 0.5]], np.float32)
    try:
        state = learner.join(init_replicas(algorithm, x0, 1))
        for losses in ([[1.0, math.nan], [3.0, 5.0]], [[2e12]]):
            for _ in range(3):
                state, _ = local(state, state.params - target)
            learner.observe(np.asarray(losses))
            state = learner.sync(state)
        fields = {"learner": 0, "generation": 1, "round": 2, "weight": 1.0, "push": "bad1"}
        arrays = wire.named(np.zeros(3, np.float32))
        with pytest.raises(service.RefusedBySyncer, match="its training loss nan is not"):
            client.call("Push", {**fields, "loss": math.nan}, arrays)
        with pytest.raises(service.RefusedBySyncer, match="loss must be a number"):
            client.call("Push", {**fields, "loss": "low"}, arrays)
    finally:
        learner.close()
        server.stop()
        syncer.close()
    assert [r["losses"] for r in syncer.past_rounds()] == [{"0": 3.0}, {}]
    assert syncer.members[0].loss == 3.0 and syncer.members[0].refused == 1


def test_a_restarted_syncer_keeps_its_charted_rounds_and_an_older_checkpoint_restores(
    tmp_path, monkeypatch
):
    """The rounds the page charts are in each checkpoint: a restarted syncer shows them again.
    A checkpoint of before them (no such field) restores, with none charted."""
    clock = _Clock()
    syncer = _syncer(tmp_path / "new", _algorithm(), learners=2, clock=clock)
    _rounds(syncer, 3, lambda i, r: 1.0 + r + i, clock)
    before = syncer.past_rounds()
    syncer.close()
    again = _syncer(tmp_path / "new", _algorithm(), learners=2)
    assert again.past_rounds() == before and [r["round"] for r in before] == [0, 1, 2]
    assert before[2]["losses"] == {"0": 3.0, "1": 4.0} and before[2]["bytes_in"] == 3000
    assert [r["waited"] for r in before] == [1.0, 2.0, 3.0]  # on the test clock, from its 0
    again.close()
    meta = keeping.Keeper._meta
    monkeypatch.setattr(keeping.Keeper, "_meta", lambda self, *a: {
        k: v for k, v in meta(self, *a).items() if k != "past_rounds"})  # fmt: skip
    old = _syncer(tmp_path / "old", _algorithm(), learners=2)
    _rounds(old, 1, lambda i, r: 1.0)
    old.close()
    monkeypatch.setattr(keeping.Keeper, "_meta", meta)
    restored = _syncer(tmp_path / "old", _algorithm(), learners=2)
    assert restored.round == 1 and restored.past_rounds() == [] and len(restored.members) == 2
    restored.close()


# ---- in a browser --------------------------------------------------------------------------


def _points(dom: str, chart: str) -> dict[str, int]:
    """``{series: number of points drawn}`` of the chart ``chart`` in the dumped page."""
    svg = re.search(rf'<svg id="chart-{chart}".*?</svg>', dom, re.S).group(0)
    lines = re.finditer(r'<polyline points="([^"]*)"[^>]*data-series="([^"]*)"', svg)
    return {m.group(2): len(m.group(1).split()) for m in lines}


@pytest.mark.skipif(BROWSER is None, reason="no headless browser: apt-get install chromium")
def test_the_page_in_a_browser_shows_the_learners_and_charts_the_rounds(served, tmp_path):
    """Chromium opens the one-time link the syncer would log, lands on the page with its
    session, and draws: a row per learner as the syncer holds it (status, generation, pushes,
    late, refused, capped, its last loss; no robust merge: no norm), the facts of the
    rounds, and charts of every round's points (learner 1's push of round 2 said no loss; the
    losses span a decade: a log axis). The link is then spent."""
    clock = _Clock()
    syncer, page = served(learners=2, clock=clock)
    syncer.join(1, wire.describe(X), KEYS, wire.named(X))
    with pytest.raises(Refused):
        syncer.push(1, 1, 0, 1.0, {"['w']": np.ones(3, np.float32)}, loss=math.inf)
    _rounds(syncer, 5, lambda i, r: None if (i, r) == (1, 2) else 3.0 * 0.5**r + i, clock)
    link = page.link(f"http://127.0.0.1:{page.port}")
    dom = headless(link, tmp_path, "--dump-dom")
    st = syncer.status()
    rows = [(cls, re.findall(r"<td>([^<]*)</td>", cells)) for cls, cells in
            re.findall(r'<tr class="(\w+)">((?:<td>[^<]*</td>)+)</tr>', dom)]  # fmt: skip
    assert rows == [
        (m["status"], [str(i), m["status"], str(m["generation"]), str(m["joined_round"]),
                       str(m["pushes"]), str(m["late"]), str(m["refused"]), str(m["capped"]),
                       f"{m['loss']:.4g}", "-", "-", "-"])
        for i, m in st["members"].items()
    ]  # fmt: skip
    assert [cells[8] for _, cells in rows] == ["0.1875", "1.188"]  # the last loss of each
    assert [cells[4:7] for _, cells in rows] == [["5", "0", "0"], ["5", "0", "1"]]
    assert "<b>rounds closed</b>5<" in dom and "<b>refused pushes</b>1<" in dom
    assert _points(dom, "loss") == {"learner 0": 5, "learner 1": 4}
    assert _points(dom, "wait") == {"seconds": 5}
    assert _points(dom, "bytes") == {"in": 5, "out": 5}
    scales = dict(re.findall(r'<svg id="chart-(\w+)"[^>]*data-scale="(\w+)"', dom))
    assert scales == {"loss": "log", "wait": "linear", "bytes": "log"}
    assert _ask(page, link.removeprefix(f"http://127.0.0.1:{page.port}"))[0] == 401  # spent
