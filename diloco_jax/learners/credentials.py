"""What a party's config says about who it is: its token (``syncer.token_file``, else
``$DILOCO_SERVE_TOKEN``, else the ``token`` of its ``syncer.credentials`` folder) and its TLS
files (that folder, made by ``diloco-syncer certs``). The syncer's token is the run's secret;
a learner's, its own credential or the secret it derives its credential from
(:mod:`.identity`)."""

from __future__ import annotations

import os
import pathlib

from diloco_jax.base import extras
from diloco_jax.base.access import TOKEN_ENV
from diloco_jax.base.errors import ConfigError
from diloco_jax.learners import identity


def configured_token(token_file: str, environ=os.environ, credentials: str = "") -> str:
    """The token the config names (see the module's docstring), else empty."""
    text = pathlib.Path(token_file).read_text().strip() if token_file else ""
    text = text or environ.get(TOKEN_ENV, "")
    token = pathlib.Path(credentials) / "token"
    return text or (token.read_text().strip() if credentials and token.is_file() else "")


def tls_of(credentials: str):
    """The :class:`~diloco_jax.learners.certs.Tls` of a ``syncer.credentials`` folder (None:
    no folder, no TLS)."""
    if not credentials:
        return None
    extras.require("cryptography", "TLS between learners and a syncer")
    from diloco_jax.learners import certs

    return certs.read(pathlib.Path(credentials))


def credential(sy, environ=os.environ) -> str:
    """Learner ``sy.learner``'s credential (``sy``: the config's ``syncer`` section) from its
    token (:func:`configured_token`, which must exist)."""
    text = configured_token(sy.token_file, environ, sy.credentials)
    if not text:
        raise ConfigError("a learner needs its credential: syncer.credentials (a folder of "
                          f"`diloco-syncer certs`), syncer.token_file or ${TOKEN_ENV}")  # fmt: skip
    try:
        return identity.for_learner(text, sy.learner)
    except ValueError as e:
        raise ConfigError(str(e)) from None
