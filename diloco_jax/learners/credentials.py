"""What a party's config says about who it is: its token (``syncer.token_file``, else
``$DILOCO_SERVE_TOKEN``, else the ``token`` of its ``syncer.credentials`` folder) and its TLS
files (that folder, made by ``diloco-syncer certs``). The syncer's token is the run's secret;
a learner's, its own credential or the secret it derives its credential from
(:mod:`.identity`). A token given beside the folder must agree with the folder's: one that
does not is refused rather than silently preferred (a stale ``$DILOCO_SERVE_TOKEN`` would
otherwise make every call fail authentication long after the start)."""

from __future__ import annotations

import datetime
import os
import pathlib

from diloco_jax.base import extras
from diloco_jax.base.access import TOKEN_ENV
from diloco_jax.base.errors import ConfigError
from diloco_jax.learners import identity


def _agree(given: str, folder: str) -> bool:
    """Whether ``given`` is the folder's token, or the run's secret that derives it (a host
    handed the secret beside its own folder)."""
    if given == folder:
        return True
    index = identity.named_learner(folder)
    if index is not None:
        return identity.learner_credential(given, index) == folder
    return identity.operator_credential(given) == folder


def configured_token(token_file: str, environ=os.environ, credentials: str = "") -> str:
    """The token the config names (see the module's docstring), else empty. Raises
    :class:`ConfigError` (one line) when ``token_file`` or ``$DILOCO_SERVE_TOKEN`` disagrees
    with the ``token`` of the ``credentials`` folder."""
    path = pathlib.Path(credentials) / "token"
    folder = path.read_text().strip() if credentials and path.is_file() else ""
    file_text = pathlib.Path(token_file).read_text().strip() if token_file else ""
    env_text = environ.get(TOKEN_ENV, "")
    for given, source, fix in [(file_text, f"syncer.token_file = {token_file}",
                                "remove syncer.token_file"),
                               (env_text, f"${TOKEN_ENV}", f"unset ${TOKEN_ENV}")]:  # fmt: skip
        if folder and given and not _agree(given, folder):
            raise ConfigError(f"{source} and {path} (syncer.credentials) hold different tokens: "
                              f"{fix} (the folder's token goes with its certificates)")  # fmt: skip
    return file_text or env_text or folder


def tls_of(credentials: str, now: datetime.datetime | None = None):
    """The :class:`~diloco_jax.learners.certs.Tls` of a ``syncer.credentials`` folder (None:
    no folder, no TLS), its certificates' dates checked at ``now`` (None: the clock's) by
    :func:`~diloco_jax.learners.certs.read`; raises :class:`ConfigError` (one line)."""
    if not credentials:
        return None
    extras.require("cryptography", "TLS between learners and a syncer")
    from diloco_jax.learners import certs

    try:
        return certs.read(pathlib.Path(credentials), now=now)
    except ValueError as e:  # a learner's start reports a ConfigError in one line
        raise ConfigError(f"syncer.credentials = {credentials}: {e}") from None


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
