"""``diloco-syncer certs``: the folders a run's parties need, re-running without harm, the
readers, and a real TLS handshake between the syncer's and a learner's certificates."""

import ipaddress
import pathlib
import socket
import ssl
import stat
import threading

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco_jax.learners import certs, identity

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
