"""A learner that cannot reach its syncer says why in one line, the cause and the fix, and gives
up: at once (after :data:`~diloco_jax.learners.service.HOPELESS_TRIES` tries) when no retry can
mend it, after its patience when the syncer may yet come. Each case is real: a gRPC client
against a loopback endpoint (a syncer with certificates of the wrong names or of another run,
a name that does not resolve, a port nobody listens on, a peer that is not a TLS gRPC server),
so the C core's own texts are what :mod:`diloco_jax.learners.unreachable` reads."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from diloco_jax.learners import certs, identity, service, unreachable
from tests.test_learners import _algorithm, _syncer

BEAT = ("Heartbeat", {"learner": 0, "generation": 1})
HOPELESS = 5.0  # patience of the misconfiguration cases: more than their tries ever take


def _run(tmp_path, name: str, hosts=certs.DEFAULT_HOSTS):
    """The folder of a run's credentials made by ``diloco-syncer certs``."""
    certs.make(tmp_path / name, 1, list(hosts), log=lambda _: None)
    return tmp_path / name


def _serving(tmp_path, folder, **kw) -> service.Server:
    secret = (folder / "ca" / "secret").read_text().strip()
    syncer = _syncer(tmp_path / "served", _algorithm(), learners=1)
    return service.Server(syncer, "127.0.0.1", 0, secret=secret,
                          tls=certs.read(folder / "syncer"), **kw).start()  # fmt: skip


def _client(address: str, folder=None, patience: float = HOPELESS) -> service.Client:
    tls = None if folder is None else certs.read(folder)
    return service.Client(address, identity.learner_credential("s", 0), timeout=5,
                          patience=patience, tls=tls, credentials=str(folder or ""))  # fmt: skip


def _given_up(client: service.Client, caplog) -> tuple[str, list[str]]:
    """The one line the client gives up with, and its retries' log lines."""
    with caplog.at_level(logging.WARNING, "diloco_jax"):
        with pytest.raises(service.SyncerUnreachable) as raised:
            client.call(*BEAT)
    client.close()
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    line = str(raised.value)
    assert "\n" not in line and "failed to connect" not in line, line
    assert all("\n" not in r and "failed to connect" not in r for r in retries), retries
    return line, retries


class _Garbage:
    """A plain TCP server on loopback that answers every connection with bytes that are neither
    TLS nor HTTP/2."""

    def __init__(self):
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.sendall(b"hello, this is not a syncer\n")
                    conn.recv(4096)
                except OSError:
                    pass

    def close(self) -> None:
        self._sock.close()


def test_a_syncer_certificate_without_the_address_name_is_given_up_naming_certs_hosts(
    tmp_path, caplog
):
    """Certificates made for ``localhost`` alone; the learner reaches the syncer at
    ``127.0.0.1``, a name its certificate does not hold."""
    run = _run(tmp_path, "run", hosts=["localhost"])
    server = _serving(tmp_path, run)
    address = f"127.0.0.1:{server.port}"
    try:
        line, retries = _given_up(_client(address, run / "learner_0"), caplog)
    finally:
        server.stop()
    assert line.startswith(f"the syncer at {address} presents a certificate without the name "
                           "127.0.0.1: remove DIR/syncer/cert.pem, rerun `diloco-syncer certs "
                           "DIR --learners N --hosts 127.0.0.1,...`"), line  # fmt: skip
    assert len(retries) == service.HOPELESS_TRIES - 1, retries


def test_a_syncer_certificate_of_another_run_is_given_up_naming_the_learners_folder(
    tmp_path, caplog
):
    """The syncer's credentials from one ``diloco-syncer certs`` run, the learner's from a
    second: the syncer's certificate is not signed by the CA the learner holds."""
    server = _serving(tmp_path, _run(tmp_path, "first"))
    mine = _run(tmp_path, "second") / "learner_0"
    try:
        line, retries = _given_up(_client(f"127.0.0.1:{server.port}", mine), caplog)
    finally:
        server.stop()
    assert line == (f"the syncer at 127.0.0.1:{server.port} presents a certificate not signed by "
                    f"the CA in syncer.credentials = {mine}: give this learner the folder made "
                    "with the syncer's (the same `diloco-syncer certs DIR`)")  # fmt: skip
    assert len(retries) == service.HOPELESS_TRIES - 1, retries


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plaintext"])
def test_a_peer_that_is_not_a_tls_grpc_server_is_given_up(tmp_path, caplog, tls):
    """A plain TCP server that answers garbage: to a learner with TLS its handshake fails
    (WRONG_VERSION_NUMBER, as a second syncer without TLS on the port would), to a plaintext
    one it is not HTTP/2."""
    peer = _Garbage()
    folder = _run(tmp_path, "run") / "learner_0" if tls else None
    try:
        line, retries = _given_up(_client(peer.address, folder), caplog)
    finally:
        peer.close()
    if tls:
        assert line == (f"{peer.address} does not speak TLS (WRONG_VERSION_NUMBER): a syncer "
                        "without syncer.credentials, or another program on that port: start "
                        "the syncer with syncer.credentials = its folder, or check "
                        "syncer.address")  # fmt: skip
    else:
        assert line.startswith(f"{peer.address} is not a syncer (it answers, but not in gRPC"), line
        assert line.endswith(": set syncer.address to the syncer's own port"), line
    assert len(retries) == service.HOPELESS_TRIES - 1, retries


def test_the_syncers_https_status_page_is_no_syncer(tmp_path, caplog):
    """A learner pointed at the syncer's status port (HTTPS with the syncer's own certificate):
    the handshake succeeds, but the page does not speak gRPC."""
    from diloco_jax.learners.status import StatusServer

    run = _run(tmp_path, "run")
    syncer = _syncer(tmp_path / "served", _algorithm(), learners=1)
    page = StatusServer(syncer, "127.0.0.1", 0, secret="s",
                        tls=certs.read(run / "syncer")).start()  # fmt: skip
    address = f"127.0.0.1:{page.port}"
    try:
        line, retries = _given_up(_client(address, run / "learner_0"), caplog)
    finally:
        page.stop()
    assert line.startswith(f"{address} is not a syncer"), line
    assert len(retries) == service.HOPELESS_TRIES - 1, retries


def test_a_name_that_does_not_resolve_says_check_syncer_address(tmp_path, caplog):
    """Tried for the whole patience (a host may yet enter DNS), then the one line."""
    client = _client("no-such-host.invalid:50551", _run(tmp_path, "run") / "learner_0", 0.5)
    line, retries = _given_up(client, caplog)
    assert line.startswith("no-such-host.invalid does not resolve for "), line
    assert line.endswith("s: check syncer.address"), line
    assert all(r.startswith("no-such-host.invalid does not resolve; retrying in") for r in retries)


def test_a_refused_connection_is_retried_for_the_patience_then_said_in_words(caplog):
    """Nobody listens (a socket bound to the port, so that nothing else takes it): a syncer not
    yet up, so tried past the tries a misconfiguration gets, until the patience is spent."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{bound.getsockname()[1]}"
        line, retries = _given_up(_client(address, patience=1.5), caplog)
    assert line.startswith(f"nothing listens at {address} (connection refused) for "), line
    assert line.endswith("s: start the syncer there, or check syncer.address"), line
    assert len(retries) >= service.HOPELESS_TRIES, retries
    assert retries[0].startswith(f"nothing listens at {address} (connection refused); retrying")


def test_a_plaintext_learner_at_a_tls_syncer_is_told_to_set_its_credentials(tmp_path, caplog):
    """The syncer closes a connection that does not start TLS; so does a syncer stopping, so
    this is tried for the patience."""
    server = _serving(tmp_path, _run(tmp_path, "run"))
    try:
        line, _ = _given_up(_client(f"127.0.0.1:{server.port}", patience=0.5), caplog)
    finally:
        server.stop()
    address = f"127.0.0.1:{server.port}"
    assert line.startswith(f"the syncer at {address} closes the connection for "), line
    assert line.endswith("and the syncer has TLS, set syncer.credentials to this learner's "
                         "folder"), line  # fmt: skip


def test_texts_outside_the_loopback_cases_are_read_too():
    """Older grpcio (``pyproject``: grpcio>=1.60) words a name mismatch as its peer name; a
    text of no row (here a reset seen by a plaintext learner) is said without the C core's
    preamble, and tried again."""
    older = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.5:50551: "
             "Peer name syncer.example is not in peer certificate")  # fmt: skip
    why = unreachable.cause(older, "syncer.example:50551", tls=True)
    assert why.what.endswith("without the name syncer.example") and not why.transient
    reset = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:5: "
             "recvmsg:Connection reset by peer (104)")  # fmt: skip
    why = unreachable.cause(reset, "[::1]:5", tls=False)
    said = "the syncer at [::1]:5 cannot be reached (recvmsg:Connection reset by peer (104))"
    assert why.what == said and why.transient


def test_a_learner_with_another_runs_credentials_exits_with_the_one_line(
    tmp_path, monkeypatch, capsys
):
    """``python -m diloco_jax.train`` as a learner whose syncer.credentials are of another
    run: exit 1 and the one line naming the folder, not a retry every 5 s."""
    from diloco_jax.train import main

    server = _serving(tmp_path, _run(tmp_path, "first"))
    mine = _run(tmp_path, "second") / "learner_0"
    monkeypatch.delenv("DILOCO_SERVE_TOKEN", raising=False)
    try:
        code = main(["--config", "tiny", "--workdir", str(tmp_path / "learner"),
                     "--config.parallel.replicas=1", "--config.outer.sync_every=10",
                     f"--config.syncer.address=127.0.0.1:{server.port}",
                     f"--config.syncer.credentials={mine}"])  # fmt: skip
    finally:
        server.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1, err
    assert err[-1].startswith(f"error: the syncer at 127.0.0.1:{server.port} presents a "
                              f"certificate not signed by the CA in syncer.credentials = "
                              f"{mine}: give this learner"), err[-1]  # fmt: skip
