"""``python -m diloco_jax.syncer`` (``diloco-syncer``): serves the rounds of independent
learners at ``syncer.address`` until stopped (SIGTERM or SIGINT: the last round is already
written; a restarted syncer goes on from it).

    python -m diloco_jax.syncer --config tiny --workdir runs/syncer \\
        --config.syncer.address=127.0.0.1:50551 --config.syncer.learners=4

Learners: the same config with ``--config.syncer.learner=I`` and the token (``syncer.token_file``
or ``$DILOCO_SERVE_TOKEN``; without either the syncer writes a new one to WORKDIR/syncer_token).
"""

from __future__ import annotations

import os
import pathlib
import secrets
import signal
import sys
import threading

from diloco_jax import config as config_lib
from diloco_jax.base.axes import REPLICA
from diloco_jax.base.extras import MissingExtra
from diloco_jax.config import cli, recipe
from diloco_jax.learners import learner as learner_lib
from diloco_jax.learners import service
from diloco_jax.learners.status import StatusServer
from diloco_jax.learners.syncer import Syncer
from diloco_jax.watch import reporting
from diloco_jax.watch.reporting import log


def syncer_token(token_file: str, workdir: pathlib.Path, environ=os.environ) -> str:
    """The token learners must present: ``token_file``'s, else ``$DILOCO_SERVE_TOKEN``, else a
    new one written to ``workdir/syncer_token`` (readable by this user only)."""
    text = learner_lib.configured_token(token_file, environ)
    if text:
        return text
    path = workdir / "syncer_token"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()  # a restarted syncer keeps its learners' token
    text = secrets.token_urlsafe(24)
    workdir.mkdir(parents=True, exist_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text + "\n")
    log.info("the learners' token is in %s (syncer.token_file)", path)
    return text


def make_syncer(cfg: config_lib.Config, workdir: pathlib.Path, cls=Syncer, **extra) -> Syncer:
    """The syncer of ``cfg``'s learners: the core's algorithm built as a run builds it
    (``cls``: a subclass, given ``extra`` keywords, as the replay's virtual syncer)."""
    config_lib.validate(cfg)
    algorithm = recipe.algorithm_from_config(cfg, REPLICA, outer_lr_as_input=True)
    sy = cfg.syncer
    return cls(algorithm, workdir, **extra, keys=learner_lib.shared_keys(config_lib.keys(cfg)),
                  learners=sy.learners, timeout=sy.timeout, dead_after=sy.dead_after,
                  quorum=sy.quorum, grace=sy.grace, adaptive_grace=sy.adaptive_grace,
                  max_late=sy.max_late, rounds=sy.rounds, examples=sy.examples,
                  outer_scale=recipe.outer_lr_input(cfg), codec=recipe.codec_of(cfg),
                  weigh_rounds=sy.weigh_rounds, late_weight=sy.late_weight,
                  answer_mean=cfg.outer.mode == "eager")  # fmt: skip


def serve(cfg: config_lib.Config, workdir: pathlib.Path):
    """The syncer of ``cfg`` listening at ``syncer.address``, and its status server at
    ``syncer.status_port`` (None when 0), both started."""
    host, _, port = cfg.syncer.address.rpartition(":")
    token = syncer_token(cfg.syncer.token_file, workdir)
    server = service.Server(make_syncer(cfg, workdir), host, int(port), token=token,
                            wait_timeout=cfg.syncer.timeout * 4 + 30)  # fmt: skip
    page = None
    if cfg.syncer.status_port:
        page = StatusServer(server.syncer, host, cfg.syncer.status_port, token=token).start()
        log.info("syncer status: http://%s:%d/ (/status, /metrics)", host, page.port)
    return server.start(), page


def main(argv: list[str] | None = None, *, prog: str = "python -m diloco_jax.syncer") -> int:
    args = cli.parse(sys.argv[1:] if argv is None else argv, prog=prog, description=__doc__)
    if args is None:
        return 0
    cfg, workdir = args.cfg, pathlib.Path(args.workdir)
    reporting.setup_logging()
    if not cfg.syncer.address:
        print("error: config key syncer.address must be HOST:PORT to listen at", file=sys.stderr)
        return 2
    try:
        server, page = serve(cfg, workdir)
    except (config_lib.ConfigError, MissingExtra, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("syncer listening at %s:%d for %d learners (round %d); workdir %s", server.host,
             server.port, cfg.syncer.learners, server.syncer.round, workdir)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("syncer stopping at round %d", server.syncer.round)
    server.stop()
    if page is not None:
        page.stop()
    server.syncer.close()
    return 0
