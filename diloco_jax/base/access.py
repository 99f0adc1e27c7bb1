"""Who may talk to a server of the package (a run's or a sweep's, later a syncer's): the
environment variable that holds its token, and which hosts are this machine only."""

from __future__ import annotations

import ipaddress

TOKEN_ENV = "DILOCO_SERVE_TOKEN"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts connections from this
    machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
