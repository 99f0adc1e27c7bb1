"""``diloco-syncer certs``: the folders a run's parties need, re-running without harm, the
readers, and a real TLS handshake between the syncer's and a learner's certificates."""

import datetime
import ipaddress
import logging
import os
import pathlib
import socket
import ssl
import stat
import threading
from types import SimpleNamespace

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco_jax.base.access import TOKEN_ENV
from diloco_jax.learners import certs, credentials, identity

PARTY_FILES = {"ca.pem", "cert.pem", "key.pem", "token"}
PRIVATE_FILES = {"ca.key", "secret", "key.pem", "token"}


def _make(out: pathlib.Path, learners: int, hosts: list[str] | None = None) -> list[str]:
    """Run ``certs.make`` and return the lines it logged."""
    lines: list[str] = []
    certs.make(out, learners, hosts or [], log=lines.append)
    return lines


def _cert(path: pathlib.Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _files(out: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _usages(cert: x509.Certificate) -> list:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_make_lays_out_one_folder_per_party(tmp_path):
    out = tmp_path / "creds"
    lines = _make(out, 2, ["syncer.example.org", "10.1.2.3"])
    parties = ["syncer", "learner_0", "learner_1", "operator"]
    want = {f"ca/{n}" for n in ("ca.pem", "ca.key", "secret")}
    want |= {f"{party}/{n}" for party in parties for n in PARTY_FILES}
    assert set(_files(out)) == want
    assert len(lines) == 1 + len(parties) + 1  # the CA, each party, what to copy where
    assert lines[2] == f"wrote {out / 'learner_0'} (learner 0: ca.pem cert.pem key.pem token)"
    assert "learner_I" in lines[-1] and "operator" in lines[-1]

    ca = _cert(out / "ca" / "ca.pem")
    assert certs.common_name((out / "ca" / "ca.pem").read_bytes()) == certs.CA_NAME
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    for party, cn, eku in [("syncer", "syncer", ExtendedKeyUsageOID.SERVER_AUTH),
                           ("learner_0", "learner-0", ExtendedKeyUsageOID.CLIENT_AUTH),
                           ("learner_1", "learner-1", ExtendedKeyUsageOID.CLIENT_AUTH),
                           ("operator", "operator", ExtendedKeyUsageOID.CLIENT_AUTH)]:  # fmt: skip
        assert (out / party / "ca.pem").read_bytes() == (out / "ca" / "ca.pem").read_bytes()
        cert = _cert(out / party / "cert.pem")
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == cn
        assert _usages(cert) == [eku]
    san = _cert(out / "syncer" / "cert.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert san.value.get_values_for_type(x509.DNSName) == ["syncer.example.org"]
    assert san.value.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.1.2.3")]

    for path in out.rglob("*"):
        if path.name in PRIVATE_FILES:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    secret = (out / "ca" / "secret").read_text().strip()
    assert certs.token(out / "syncer") == secret
    for i in range(2):
        want_id = identity.Identity(identity.LEARNER, i)
        assert identity.identify(secret, certs.token(out / f"learner_{i}")) == want_id
    operator = identity.identify(secret, certs.token(out / "operator"))
    assert operator == identity.Identity(identity.OPERATOR)


def test_make_again_keeps_every_file_and_adds_what_is_missing(tmp_path):
    out = tmp_path / "creds"
    _make(out, 2)
    before = _files(out)
    lines = _make(out, 3)
    after = _files(out)
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == {f"learner_2/{n}" for n in PARTY_FILES}
    assert lines[0] == f"wrote {out / 'learner_2'} (learner 2: ca.pem cert.pem key.pem token)"
    assert len(lines) == 2
    secret = (out / "ca" / "secret").read_text().strip()
    assert identity.identify(secret, certs.token(out / "learner_2")) == identity.Identity(
        identity.LEARNER, 2
    )
    _cert(out / "learner_2" / "cert.pem").verify_directly_issued_by(_cert(out / "ca" / "ca.pem"))

    assert len(_make(out, 3)) == 1  # nothing written: only what to copy where
    assert _files(out) == after

    (out / "learner_0" / "cert.pem").unlink()  # renewing a certificate keeps its key
    assert _make(out, 3)[0] == f"wrote {out / 'learner_0'} (learner 0: cert.pem)"
    renewed = _cert(out / "learner_0" / "cert.pem")
    assert (
        renewed.public_key()
        == x509.load_pem_x509_certificate(after["learner_0/cert.pem"]).public_key()
    )


def test_make_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(ValueError, match="at least 0"):
        _make(tmp_path / "a", -1)
    out = tmp_path / "creds"
    _make(out, 1)
    (out / "ca" / "secret").unlink()
    with pytest.raises(ValueError, match="secret") as e:
        _make(out, 2)
    assert "\n" not in str(e.value)
    assert not (out / "learner_1").exists()


def test_read_returns_the_pems_or_says_how_to_make_them(tmp_path):
    out = tmp_path / "creds"
    _make(out, 1)
    folder = out / "learner_0"
    tls = certs.read(folder)
    assert tls == certs.Tls(*((folder / n).read_bytes() for n in ("ca.pem", "cert.pem", "key.pem")))
    assert certs.common_name(tls.cert) == "learner-0"

    for missing in (tmp_path / "nowhere", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(ValueError, match="diloco-syncer certs") as e:
            certs.read(missing)
        assert str(missing) in str(e.value) and "\n" not in str(e.value)
    (folder / "key.pem").unlink()
    with pytest.raises(ValueError, match="key.pem"):
        certs.read(folder)
    (folder / "cert.pem").unlink()
    assert certs.read(folder) == certs.Tls((folder / "ca.pem").read_bytes(), None, None)
    assert certs.token(tmp_path / "empty") == ""


def _handshake(server: pathlib.Path, client: pathlib.Path, trust: pathlib.Path) -> dict:
    """Connect a client with ``client``'s certificate, trusting ``trust``, to a server with
    ``server``'s files over a socket pair, the server requiring a client certificate; returns
    what each side saw."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(server / "cert.pem", server / "key.pem")
    server_ctx.load_verify_locations(server / "ca.pem")
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # checks the host name and the CA
    client_ctx.load_cert_chain(client / "cert.pem", client / "key.pem")
    client_ctx.load_verify_locations(trust)
    for ctx in (server_ctx, client_ctx):  # the checks Python 3.13 makes by default
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    seen: dict = {}
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                seen["peer"] = certs.common_name(
                    ssl.DER_cert_to_PEM_cert(s.getpeercert(binary_form=True)).encode()
                )
                s.sendall(b"ok")
        except (ssl.SSLError, OSError) as e:
            seen["server_error"] = e

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname="localhost") as c:
            seen["reply"] = c.recv(2)  # under TLS 1.3 a refused client learns it here
    except (ssl.SSLError, OSError) as e:
        seen["client_error"] = e
    finally:
        b.close()
        thread.join(10)
        a.close()
    assert not thread.is_alive()
    return seen


def test_tls_handshake_between_syncer_and_learner(tmp_path):
    _make(tmp_path / "out", 1)
    _make(tmp_path / "out2", 1)
    san = _cert(tmp_path / "out" / "syncer" / "cert.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert [str(n.value) for n in san.value] == list(certs.DEFAULT_HOSTS)

    syncer, ca = tmp_path / "out" / "syncer", tmp_path / "out" / "learner_0" / "ca.pem"
    ok = _handshake(syncer, tmp_path / "out" / "learner_0", ca)
    assert ok == {"peer": "learner-0", "reply": b"ok"}

    stranger = _handshake(syncer, tmp_path / "out2" / "learner_0", ca)  # another run's learner
    assert "peer" not in stranger and stranger.get("reply", b"") != b"ok"
    assert "certificate verify failed" in str(stranger["server_error"])
    impostor = _handshake(
        syncer, tmp_path / "out" / "learner_0", tmp_path / "out2" / "ca" / "ca.pem"
    )
    assert "certificate verify failed" in str(impostor["client_error"])  # another run's syncer


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def test_a_token_from_elsewhere_that_disagrees_with_the_folder_is_refused(tmp_path):
    from diloco_jax.learners import command

    out = tmp_path / "creds"
    _make(out, 1)
    secret, syncer = certs.token(out / "syncer"), str(out / "syncer")
    learner = SimpleNamespace(token_file="", credentials=str(out / "learner_0"), learner=0)
    stale = {TOKEN_ENV: "a-stale-token"}
    with pytest.raises(ValueError, match=r"\$DILOCO_SERVE_TOKEN .*syncer\.credentials.*unset") as e:
        command.syncer_token("", tmp_path / "work", stale, credentials=syncer)
    assert syncer in str(e.value) and "a-stale-token" not in str(e.value)
    assert "\n" not in str(e.value) and secret not in str(e.value)
    with pytest.raises(ValueError, match=r"\$DILOCO_SERVE_TOKEN"):
        credentials.credential(learner, stale)
    token_file = tmp_path / "token"
    token_file.write_text("another-token\n")
    with pytest.raises(ValueError, match=r"syncer\.token_file = .*token .*remove syncer\.token_f"):
        credentials.configured_token(str(token_file), {}, syncer)

    token_file.write_text(secret + "\n")  # agreeing sources: the same token, as before
    assert credentials.configured_token(str(token_file), {TOKEN_ENV: secret}, syncer) == secret
    assert command.syncer_token("", tmp_path / "work", {TOKEN_ENV: secret}, syncer) == secret
    assert not (tmp_path / "work").exists()
    want = certs.token(out / "learner_0")  # the run's secret derives the folder's credential
    assert credentials.credential(learner, {TOKEN_ENV: secret}) == want
    assert credentials.credential(learner, {TOKEN_ENV: want}) == want


def test_read_refuses_an_expired_or_early_certificate_and_warns_before(tmp_path, caplog):
    out = tmp_path / "creds"
    certs.make(out, 1, [], days=365, log=lambda _: None)
    (out / "learner_0" / "cert.pem").unlink()
    certs.make(out, 1, [], days=3, log=lambda _: None)  # a renewal for 3 days, under the CA
    folder, now = out / "learner_0", _now()
    cert_end = _cert(folder / "cert.pem").not_valid_after_utc
    with pytest.raises(ValueError, match=r"cert\.pem expired on .*diloco-syncer certs") as e:
        certs.read(folder, now=now + datetime.timedelta(days=4))
    assert str(folder / "cert.pem") in str(e.value) and f"{cert_end:%Y-%m-%d}" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"expired on"):  # what the learner and syncer call
        credentials.tls_of(str(folder), now=now + datetime.timedelta(days=4))
    with pytest.raises(ValueError, match=r"ca\.pem is not valid until .*clock"):  # the CA first
        certs.read(folder, now=now - datetime.timedelta(days=1))

    logger = logging.getLogger("diloco_jax")
    propagate, logger.propagate = logger.propagate, True  # a run's logging may have cut it
    try:
        with caplog.at_level(logging.WARNING, logger="diloco_jax"):
            caplog.clear()  # what came before (make's own reading, where it propagated) aside
            assert certs.read(folder, now=now).cert == (folder / "cert.pem").read_bytes()
            # one record, once: a worker whose earlier test left pytest's capturing handler on
            # this logger as well as on the root captures each record twice (the same object)
            warned = dict.fromkeys(r for r in caplog.records if r.levelno >= logging.WARNING)
            said = [r.getMessage() for r in warned]
            caplog.clear()
            certs.read(out / "syncer", now=now)  # a year left: nothing said
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        logger.propagate = propagate
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith(f"{folder / 'cert.pem'} expires on {cert_end:%Y-%m-%d %H:%M}")
    assert "diloco-syncer certs" in said[0]

    (folder / "cert.pem").unlink()
    (folder / "key.pem").unlink()  # the CA alone: it expires too
    with pytest.raises(ValueError, match=r"ca\.pem .*expired on .*diloco-syncer certs") as e:
        certs.read(folder, now=now + datetime.timedelta(days=400))
    assert str(folder / "ca.pem") in str(e.value)


@pytest.mark.parametrize("mask", [0o000, 0o002, 0o077], ids=["umask000", "umask002", "umask077"])
def test_certs_are_private_whatever_the_umask(tmp_path, mask):
    out, shared = tmp_path / "made" / "creds", tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    old = os.umask(mask)
    try:
        _make(out, 1)
        made = stat.S_IMODE(out.stat().st_mode)
        for folder in (out, out / "ca", out / "learner_0"):  # loosened since: tightened on reuse
            os.chmod(folder, 0o777)
        _make(out, 2)
        _make(shared, 0)
    finally:
        os.umask(old)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o777  # the user's own folder: left alone
    for path in [tmp_path / "made", *(tmp_path / "made").rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert not mode & 0o022, f"{path} {mode:o}"
        if path.name in PRIVATE_FILES or (path.is_dir() and path not in (tmp_path / "made", out)):
            assert not mode & 0o077, f"{path} {mode:o}"  # a secret, or a party's folder
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (out, out / "ca", out / "learner_1")}
    assert modes == {out: 0o755, out / "ca": 0o700, out / "learner_1": 0o700}  # exactly
    assert made == 0o755  # as made, before any reuse
    assert stat.S_IMODE((out / "ca" / "ca.pem").stat().st_mode) == 0o644  # readable by all
