"""Why a learner cannot reach its syncer, in words: gRPC reports every failure to connect as
``UNAVAILABLE`` with its C core's text (a TLS error, a resolver's, a socket's); :func:`cause`
reads that text against :data:`TABLE` and says the cause, its fix, and whether trying again can
help. The texts are grpcio's own, each reproduced on loopback by ``tests/test_learner_errors.py``
(grpcio 1.85), and older grpcio's where it worded them otherwise."""

from __future__ import annotations

import re
from typing import NamedTuple

# (texts, any of which names the cause; the cause; whether a retry may succeed); first row wins
TABLE = (
    (("Hostname Verification Check failed", "is not in peer certificate"), "name", False),
    (("CERTIFICATE_VERIFY_FAILED",), "ca", False),
    (("WRONG_VERSION_NUMBER",), "not_tls", False),
    (("Failed parsing HTTP/2", "missing selected ALPN"), "not_grpc", False),
    (("errors resolving", "DNS resolution failed"), "resolve", True),  # a host not yet in DNS
    (("Connection refused",), "refused", True),  # a syncer not yet up, or restarting
    (("Socket closed",), "closed", True),  # a syncer stopping (or refusing this learner's TLS)
)
CERTS = "diloco-syncer certs DIR --learners N --hosts"


class Cause(NamedTuple):
    """``what``: the cause in words (the retry's log line); ``fix``: what to do (with ``what``,
    the one line a learner gives up with); ``transient``: a retry may succeed."""

    what: str
    fix: str
    transient: bool


def host_of(address: str) -> str:
    """The host of ``HOST:PORT`` (``[V6]:PORT``: the bare address)."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or "]" in address else address
    return host.strip("[]")


def cause(details: str, address: str, *, tls: bool, credentials: str = "") -> Cause:
    """The :class:`Cause` of a failed call to the syncer at ``address`` whose gRPC ``details``
    are these; ``tls``: whether this learner speaks TLS; ``credentials``: the folder its CA came
    from (``syncer.credentials``), named when the syncer's certificate is not of that CA."""
    kind, transient = next(((k, t) for texts, k, t in TABLE if any(s in details for s in texts)),
                           ("", True))  # fmt: skip
    host = host_of(address)
    held = f"the CA in syncer.credentials = {credentials}" if credentials else "this learner's CA"
    what, fix = {
        "name": (f"the syncer at {address} presents a certificate without the name {host}",
                 f"remove DIR/syncer/cert.pem, rerun `{CERTS} {host},...` and give the syncer "
                 "its new folder (or set syncer.address to a name its certificate holds)"),
        "ca": (f"the syncer at {address} presents a certificate not signed by {held}",
               "give this learner the folder made with the syncer's (the same `diloco-syncer "
               "certs DIR`)"),
        "not_tls": (f"{address} does not speak TLS (WRONG_VERSION_NUMBER): a syncer without "
                    "syncer.credentials, or another program on that port",
                    "start the syncer with syncer.credentials = its folder, or check "
                    "syncer.address"),
        "not_grpc": (f"{address} is not a syncer (it answers, but not in gRPC: another program, "
                     "or the syncer's status page, on that port)",
                     "set syncer.address to the syncer's own port"),
        "resolve": (f"{host} does not resolve", "check syncer.address"),
        "refused": (f"nothing listens at {address} (connection refused)",
                    "start the syncer there, or check syncer.address"),
        "closed": (f"the syncer at {address} closes the connection",
                   "if it persists: with syncer.mutual_tls, give this learner its own folder of "
                   "the syncer's `diloco-syncer certs DIR`" if tls else "if it persists and "
                   "the syncer has TLS, set syncer.credentials to this learner's folder"),
    }.get(kind, (f"the syncer at {address} cannot be reached ({_last(details)})",
                 "check that it runs and syncer.address"))  # fmt: skip
    return Cause(what, fix, transient)


def _last(details: str) -> str:
    """The C core's last error without its preamble and the address it repeats."""
    return re.sub(r"^.*last error: \w+: (ipv[46]:\S+: )?", "", details)
