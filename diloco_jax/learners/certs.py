"""TLS certificates and credentials for one run of learners and a syncer (``diloco-syncer certs
DIR``), and the readers the syncer and the learners load them with.

:func:`make` lays out one folder per party, each holding exactly what that party's host needs:

* ``ca/``: the run's CA (``ca.pem``, ``ca.key``) and secret; it stays with the operator, who
  makes more certificates with it later;
* ``syncer/``: ``ca.pem`` (verifies the learners), ``cert.pem`` and ``key.pem`` (its server
  certificate, one name per host it is reached by) and ``token`` (the run's secret); with
  syncer shards (``--shards S``), ``shard_K/`` alike for shards 1 to S-1, its certificate
  also a client's (it calls shard 0);
* ``learner_I/`` and ``operator/``: ``ca.pem`` (verifies the syncer), a client certificate and
  key, and ``token``, the party's credential (:mod:`diloco_jax.learners.identity`).

Keys are ECDSA P-256 in unencrypted PKCS8, certificates SHA-256 signed. Private keys, the secret
and tokens are created readable by their owner only, certificates readable by all, ``ca/`` and
each party's folder open to their owner only, whatever the umask. Running :func:`make` again
reuses the CA and secret and writes only the files that are missing (more learners, or a
certificate deleted to renew it), so every credential already handed out stays valid; no file is
overwritten, and a folder it reuses is tightened to these modes if it was looser.

:func:`read` checks the dates of the certificates it loads, so that a party refuses to start
with an expired (or not yet valid) certificate instead of failing every handshake, and warns
:data:`WARN_BEFORE` ahead of the expiry.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import pathlib
import secrets
import stat
from collections.abc import Callable, Sequence
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco_jax.learners import identity

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")  # the syncer's names when none are given
CA_NAME = "diloco-jax run CA"
SKEW = datetime.timedelta(minutes=5)  # certificates are valid this long before they are made
PRIVATE, PUBLIC = 0o600, 0o644
PRIVATE_DIR, OPEN_DIR = 0o700, 0o755  # a party's folder and ca/; the output folder, its parents
PEM = serialization.Encoding.PEM
MAKE_HINT = "make it with `diloco-syncer certs DIR`"
WARN_BEFORE = datetime.timedelta(days=7)  # an expiry this close is warned about at start
RENEW = ("remove it and run `diloco-syncer certs DIR ...` again (it signs a new certificate for "
         "the same key), then copy it here")  # fmt: skip
RENEW_CA = ("make the run's credentials anew with `diloco-syncer certs NEW_DIR --learners N "
            "--hosts ...` (this is its CA) and give every party its new folder")  # fmt: skip
logger = logging.getLogger("diloco_jax")


class Tls(NamedTuple):
    """What one party loads to speak TLS: ``ca`` (PEM) verifies the other side; ``cert`` (its
    certificate chain, PEM) and ``key`` (its private key, PEM) are both None when absent."""

    ca: bytes
    cert: bytes | None
    key: bytes | None


class _Ca(NamedTuple):
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    secret: str


def _read_bytes(path: pathlib.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None


def _write(path: pathlib.Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (a key is never readable by others, not even
    for a moment), then exactly ``mode`` whatever the umask; an existing file is never
    replaced."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
        os.fchmod(f.fileno(), mode)
        f.write(data)


def _folder(path: pathlib.Path, mode: int, *, tighten: bool = True) -> None:
    """Make ``path`` with exactly ``mode`` whatever the umask (``mkdir``'s mode is only an upper
    bound), its missing parents with :data:`OPEN_DIR` at most (``parents=True`` would ignore it
    and leave them as open as the umask allows). An existing ``path`` loses the bits ``mode``
    lacks when ``tighten`` (a reused folder made under a loose umask), and is never loosened."""
    for parent in reversed([p for p in path.parents if not p.exists()]):
        parent.mkdir(mode=OPEN_DIR, exist_ok=True)
    if not path.is_dir():
        path.mkdir(mode=mode)
        os.chmod(path, mode)
    elif tighten and stat.S_IMODE(path.stat().st_mode) & ~mode:
        os.chmod(path, stat.S_IMODE(path.stat().st_mode) & mode)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(PEM)


def _new_key(path: pathlib.Path) -> ec.EllipticCurvePrivateKey:
    key = ec.generate_private_key(ec.SECP256R1())
    pkcs8 = serialization.PrivateFormat.PKCS8
    _write(path, key.private_bytes(PEM, pkcs8, serialization.NoEncryption()), PRIVATE)
    return key


def _load_key(path: pathlib.Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(_read_bytes(path), password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path} is not an ECDSA private key")
    return key


def _sign(cn: str, key: ec.EllipticCurvePrivateKey, ca: _Ca | None, days: int,
          extensions: Sequence[x509.ExtensionType]) -> x509.Certificate:  # fmt: skip
    """A certificate for ``key`` named ``cn``, signed by ``ca`` (self-signed when None)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    issuer_key = ca.key if ca else key
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca.cert.subject if ca else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
    )
    for ext in extensions:
        builder = builder.add_extension(ext, isinstance(ext, x509.BasicConstraints | x509.KeyUsage))
    return builder.sign(issuer_key, hashes.SHA256())


def _usage(*, ca: bool) -> list[x509.ExtensionType]:
    """A CA signs certificates (and CRLs); a party signs its TLS handshakes."""
    return [x509.BasicConstraints(ca=ca, path_length=0 if ca else None), x509.KeyUsage(
        digital_signature=not ca, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
        encipher_only=False, decipher_only=False)]  # fmt: skip


def _open_ca(folder: pathlib.Path, days: int, log: Callable[[str], object]) -> _Ca:
    """The run's CA and secret in ``folder``: loaded when there, made when none of it is."""
    paths = [folder / name for name in ("ca.pem", "ca.key", "secret")]
    _folder(folder, PRIVATE_DIR)  # the CA's key: the operator's only
    if not any(p.exists() for p in paths):
        key = _new_key(paths[1])
        cert = _sign(CA_NAME, key, None, days, _usage(ca=True))
        secret = secrets.token_urlsafe(32)
        _write(paths[0], _pem(cert), PUBLIC)
        _write(paths[2], secret.encode() + b"\n", PRIVATE)
        log(f"wrote {folder} (the run's CA and secret: ca.pem ca.key secret; keep it private)")
        return _Ca(cert, key, secret)
    for path in paths:
        if not path.is_file():
            raise ValueError(f"{path} is missing: {folder} is incomplete; restore it, or remove "
                             f"the output folder to start a new run")  # fmt: skip
    try:
        cert = x509.load_pem_x509_certificate(_read_bytes(paths[0]))
    except ValueError as e:
        raise ValueError(f"{paths[0]} is not a PEM certificate: {e}") from None
    key = _load_key(paths[1])
    if key.public_key() != cert.public_key():
        raise ValueError(f"{paths[1]} is not the key of {paths[0]}")
    secret = _read_bytes(paths[2]).decode(errors="replace").strip()
    if not secret:
        raise ValueError(f"{paths[2]} is empty")
    return _Ca(cert, key, secret)


def _party(folder: pathlib.Path, ca: _Ca, cn: str, token: str, days: int,
           extensions: Sequence[x509.ExtensionType]) -> list[str]:  # fmt: skip
    """Write the files of ``folder`` that are missing; returns their names. A certificate whose
    key is there is signed for that key, so deleting ``cert.pem`` renews it."""
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    if cert_path.exists() and not key_path.exists():
        raise ValueError(f"{key_path} is missing beside {cert_path}: remove {cert_path} too "
                         f"to make a new key and certificate")  # fmt: skip
    _folder(folder, PRIVATE_DIR)  # its key and token: the party's only
    written = []
    if not (folder / "ca.pem").exists():
        _write(folder / "ca.pem", _pem(ca.cert), PUBLIC)
        written.append("ca.pem")
    if not cert_path.exists():
        if key_path.exists():
            key = _load_key(key_path)
        else:
            key = _new_key(key_path)
            written.append("key.pem")
        _write(cert_path, _pem(_sign(cn, key, ca, days, [*_usage(ca=False), *extensions])), PUBLIC)
        written.append("cert.pem")
    if not (folder / "token").exists():
        _write(folder / "token", token.encode() + b"\n", PRIVATE)
        written.append("token")
    return sorted(written)


def _san(host: str) -> x509.GeneralName:
    """An IP address as such (clients connecting by address check it), anything else a DNS name."""
    if not host.strip():
        raise ValueError(f"a host name of the syncer is empty: {host!r}")
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip()))
    except ValueError:
        return x509.DNSName(host.strip())


def make(out: pathlib.Path, learners: int, hosts: Sequence[str], *, days: int = 365,
         log: Callable[[str], object] = print, shards: int = 1) -> None:  # fmt: skip
    """Lay out the CA, secret and each party's folder for ``learners`` learners under ``out``;
    the syncer's certificate names ``hosts`` (:data:`DEFAULT_HOSTS` when empty). Certificates
    are valid for ``days`` days. With ``shards`` S > 1 (``syncer.shards``), shard 0 is the
    ``syncer/`` folder and shards 1 to S-1 get ``shard_K/``: a certificate named ``shard-K``
    for the same hosts, good for serving and for calling shard 0 as itself, and the run's
    secret. Safe to run again (see the module's docstring); ``log`` gets one line per folder
    written and one saying what to copy where."""
    if learners < 0:
        raise ValueError(f"the number of learners must be at least 0, got {learners}")
    if shards < 1:
        raise ValueError(f"the number of syncer shards must be at least 1, got {shards}")
    if days < 1:
        raise ValueError(f"certificates must be valid for at least 1 day, got days={days}")
    out = pathlib.Path(out)
    names = [_san(h) for h in (hosts or DEFAULT_HOSTS)]
    _folder(out, OPEN_DIR, tighten=(out / "ca").is_dir())  # a folder of the user's: left alone
    ca = _open_ca(out / "ca", days, log)
    client: list[x509.ExtensionType] = [x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])]
    parties = [("syncer", "syncer", "syncer", ca.secret, [
        x509.SubjectAlternativeName(names),
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])])]  # fmt: skip
    both = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    for k in range(1, shards):  # a shard but 0 serves, and calls shard 0 as itself
        parties.append((f"shard_{k}", f"syncer shard {k}", f"{identity.SHARD}-{k}", ca.secret,
                        [x509.SubjectAlternativeName(names), both]))  # fmt: skip
    for i in range(learners):
        token_ = identity.learner_credential(ca.secret, i)
        parties.append((f"learner_{i}", f"learner {i}", f"learner-{i}", token_, client))
    parties.append(
        ("operator", "operator", "operator", identity.operator_credential(ca.secret), client)
    )
    for folder, label, cn, token_, extensions in parties:
        written = _party(out / folder, ca, cn, token_, days, extensions)
        if written:
            log(f"wrote {out / folder} ({label}: {' '.join(written)})")
    learner_dirs = f"{out / 'learner_I'} to learner I's (I < {learners}), " if learners else ""
    shard_dirs = f"{out / 'shard_K'} to shard K's (0 < K < {shards}), " if shards > 1 else ""
    log(f"copy {out / 'syncer'} to the syncer's host, {shard_dirs}{learner_dirs}"
        f"{out / 'operator'} to the operator's; {out / 'ca'} stays with you (it makes more "
        "certificates)")  # fmt: skip


def _check_dates(path: pathlib.Path, pem: bytes, now: datetime.datetime, fix: str) -> None:
    """Raise ``ValueError`` (one line: the file, the date, ``fix``) when a certificate of
    ``path`` (its ``pem``) is expired or not yet valid at ``now``; warn when it expires within
    :data:`WARN_BEFORE`."""
    try:
        found = x509.load_pem_x509_certificates(pem)
    except ValueError as e:
        raise ValueError(f"{path} is not a PEM certificate ({e}): {MAKE_HINT}") from None
    for cert in found:
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        if now < start:
            at = f"{start:%Y-%m-%d %H:%M} UTC (it is {now:%Y-%m-%d %H:%M} UTC here)"
            raise ValueError(f"{path} is not valid until {at}: check this host's clock")
        if now >= end:
            raise ValueError(f"{path} expired on {end:%Y-%m-%d %H:%M} UTC: {fix}")
        if end - now <= WARN_BEFORE:
            days = (end - now) / datetime.timedelta(days=1)
            logger.warning("%s expires on %s UTC (in %.1f days); before then, %s", path,
                           f"{end:%Y-%m-%d %H:%M}", days, fix)  # fmt: skip


def read(folder: pathlib.Path, *, now: datetime.datetime | None = None) -> Tls:
    """The TLS files of one party's ``folder`` (made by :func:`make`): ``ca.pem`` is required,
    ``cert.pem`` and ``key.pem`` come together or not at all. Raises ``ValueError`` naming what
    is missing, or a certificate that is expired or not yet valid at ``now`` (aware; None: the
    clock's), the CA's first (its renewal renews everything); warns of one that expires within
    :data:`WARN_BEFORE`."""
    folder = pathlib.Path(folder)
    now = datetime.datetime.now(datetime.UTC) if now is None else now
    ca, cert, key = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    if not ca.is_file():
        raise ValueError(f"{ca if folder.is_dir() else folder} not found: {MAKE_HINT}")
    if cert.exists() != key.exists():
        missing = key if cert.exists() else cert
        raise ValueError(f"{missing} is missing (cert.pem and key.pem come together): {MAKE_HINT}")
    pair = (_read_bytes(cert), _read_bytes(key)) if cert.exists() else (None, None)
    tls = Tls(_read_bytes(ca), *pair)
    _check_dates(ca, tls.ca, now, RENEW_CA)
    if tls.cert is not None:
        _check_dates(cert, tls.cert, now, RENEW)
    return tls


def common_name(pem: bytes) -> str:
    """The subject's common name of the PEM certificate ``pem`` ("" when it has none)."""
    names = x509.load_pem_x509_certificate(pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        return ""
    value = names[0].value
    return value if isinstance(value, str) else value.decode()


def token(folder: pathlib.Path) -> str:
    """The credential in ``folder/token`` (stripped), or "" when the folder has none."""
    path = pathlib.Path(folder) / "token"
    return _read_bytes(path).decode().strip() if path.is_file() else ""
