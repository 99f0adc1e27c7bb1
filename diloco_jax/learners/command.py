"""``python -m diloco_jax.syncer`` (``diloco-syncer``): serves the rounds of independent
learners at ``syncer.address`` until every declared learner has finished (:func:`run_over`;
with ``syncer.stay``, until stopped), or until stopped (SIGTERM or SIGINT: the last round is
already written; a restarted syncer goes on from it).

    python -m diloco_jax.syncer --config tiny --workdir runs/syncer \\
        --config.syncer.address=127.0.0.1:50551 --config.syncer.learners=4

Learners: the same config with ``--config.syncer.learner=I`` and learner I's credential.

Across networks: ``diloco-syncer certs DIR --learners N --hosts NAME[,NAME...]`` makes the
run's CA, secret, certificates and credentials, a folder per host (DIR/syncer, DIR/learner_I,
DIR/operator); each host is given ``--config.syncer.credentials=`` its folder. Without one, the
syncer's secret is ``syncer.token_file``'s or ``$DILOCO_SERVE_TOKEN`` or a new one written to
WORKDIR/syncer_token, and it listens in clear (loopback only, unless ``syncer.insecure``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import secrets
import signal
import socket
import sys
import threading

from diloco_jax import config as config_lib
from diloco_jax.base import extras
from diloco_jax.base.axes import REPLICA
from diloco_jax.base.extras import MissingExtra
from diloco_jax.config import cli, recipe
from diloco_jax.learners import credentials as credentials_lib
from diloco_jax.learners import following, identity, service, sessions
from diloco_jax.learners import learner as learner_lib
from diloco_jax.learners.status import StatusServer
from diloco_jax.learners.syncer import Syncer
from diloco_jax.watch import reporting
from diloco_jax.watch.reporting import log


def syncer_token(token_file: str, workdir: pathlib.Path, environ=os.environ,
                 credentials: str = "") -> str:  # fmt: skip
    """The run's secret, from which every credential is derived (:mod:`.identity`):
    ``token_file``'s, else ``$DILOCO_SERVE_TOKEN``, else the ``credentials`` folder's, else a
    new one written to ``workdir/syncer_token`` (readable by this user only). A token file or
    ``$DILOCO_SERVE_TOKEN`` that disagrees with the folder's is refused in one line
    (:func:`~diloco_jax.learners.credentials.configured_token`), never silently preferred."""
    text = credentials_lib.configured_token(token_file, environ, credentials)
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
                  outer_scale=recipe.outer_lr_input(cfg), codec=recipe.push_codec_of(cfg),
                  weigh_rounds=sy.weigh_rounds, late_weight=sy.late_weight,
                  answer_mean=cfg.outer.mode == "eager",
                  compress_answers=cfg.compress.answers,
                  decides=sy.shard == 0, removed=config_lib.removed_learners(sy))  # fmt: skip


def serve(cfg: config_lib.Config, workdir: pathlib.Path):
    """The syncer of ``cfg`` listening at ``syncer.address`` (with ``syncer.shards``, shard
    ``syncer.shard``'s address of the list, and a shard but 0 following shard 0's rounds:
    :mod:`.following`), and its status server at ``syncer.status_port`` (None when 0), both
    started."""
    sy = cfg.syncer
    addresses = [a.strip() for a in sy.address.split(",")]
    host, _, port = addresses[sy.shard].rpartition(":")
    host = host.strip("[]")
    secret = syncer_token(sy.token_file, workdir, credentials=sy.credentials)
    tls = credentials_lib.tls_of(sy.credentials)
    if tls is not None and (tls.cert is None or tls.key is None):
        raise ValueError(f"syncer.credentials = {sy.credentials} holds no cert.pem and key.pem: "
                         "give the syncer its own folder (DIR/syncer)")  # fmt: skip
    server = service.Server(make_syncer(cfg, workdir), host, int(port), secret=secret, tls=tls,
                            mutual=sy.mutual_tls, insecure=sy.insecure,
                            wait_timeout=sy.timeout * 4 + 30, shards=sy.shards)  # fmt: skip
    if sy.shard > 0:  # asks shard 0 how each round closed, as the shard it is
        leader = service.Client(addresses[0], identity.shard_credential(secret, sy.shard),
                                tls=tls, timeout=service.DECISION_WAIT + 30,
                                credentials=sy.credentials)  # fmt: skip
        leader.label = f"syncer shard {sy.shard} asking shard 0: "
        server.follower = following.Follower(server.syncer, leader, sy.shard).start()
    page = None
    if sy.status_port:
        page = StatusServer(server.syncer, host, sy.status_port, secret=secret, tls=tls,
                            mutual=sy.mutual_tls, insecure=sy.insecure,
                            failures=server.failures).start()  # fmt: skip
        address = page_address(host, page.port, tls is not None)
        certificate = " with the operator's certificate," if sy.mutual_tls else ""
        log.info("syncer status page: %s/ (in a browser%s sign in with the operator's "
                 "credential, or open this link once within %d min: %s; scripts: /status, "
                 "/history, /metrics with the credential as a Bearer header)", address,
                 certificate, sessions.LINK_SECONDS // 60, page.link(address))  # fmt: skip
    return server.start(), page


def page_address(host: str, port: int, tls: bool) -> str:
    """The status page's address as a browser opens it (``SCHEME://HOST:PORT``; a wildcard
    ``host`` that listens on every address: this host's name)."""
    shown = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
    return f"{'https' if tls else 'http'}://{f'[{shown}]' if ':' in shown else shown}:{port}"


def run_over(syncer: Syncer, total_steps: int, log_every: int) -> bool:
    """Whether every declared learner has finished: each has left (a learner's last call) and
    the run is at its end, the syncer's last round closed (``syncer.rounds``,
    ``syncer.examples``) or as many rounds as ``train.total_steps`` holds syncs. A learner that
    left earlier was stopped and may resume; one that died without leaving may come back. (The
    syncer cannot tell a learner that lost rounds and was stopped at the run's last round from
    one that finished: that one finds no syncer when it resumes.)"""
    total = -(-total_steps // log_every) * log_every  # as the learners' loop rounds it up
    with syncer.lock:
        left = all(i in syncer.removed or (i in syncer.members and syncer.members[i].status
                                            == "left") for i in range(syncer.learners))  # fmt: skip
        return left and (syncer.finished or syncer.round >= total // syncer.algorithm.plan.period)


def make_certs(argv: list[str], prog: str) -> int:
    """``diloco-syncer certs DIR --learners N [--hosts NAMES] [--days D]``."""
    try:
        extras.require("cryptography", "making certificates")
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from diloco_jax.learners import certs

    parser = argparse.ArgumentParser(
        prog=f"{prog} certs",
        description=certs.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", metavar="DIR", help="where the folders go (made if missing)")
    parser.add_argument(
        "--learners",
        type=int,
        required=True,
        metavar="N",
        help="learners 0 .. N-1 (run again with a larger N to add some)",
    )
    parser.add_argument(
        "--hosts",
        default=",".join(certs.DEFAULT_HOSTS),
        metavar="NAMES",
        help="the syncer's names and addresses as learners reach it, comma-"
        "separated (default: %(default)s)",
    )
    parser.add_argument("--days", type=int, default=365, help="validity (default: %(default)s)")
    parser.add_argument("--shards", type=int, default=1, metavar="S",
                        help="syncer shards (syncer.shards): DIR/shard_K for K in 1 .. S-1, "
                        "their certificates naming --hosts too (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        certs.make(
            pathlib.Path(args.out),
            args.learners,
            [h.strip() for h in args.hosts.split(",") if h.strip()],
            days=args.days,
            shards=args.shards,
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None, *, prog: str = "python -m diloco_jax.syncer") -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["certs"]:
        return make_certs(argv[1:], prog)
    args = cli.parse(argv, prog=prog, description=__doc__)
    if args is None:
        return 0
    cfg, workdir = args.cfg, pathlib.Path(args.workdir)
    reporting.setup_logging()
    if not cfg.syncer.address:
        print("error: config key syncer.address must be HOST:PORT to listen at", file=sys.stderr)
        return 2
    service.tune_malloc()
    try:
        server, page = serve(cfg, workdir)
    except (config_lib.ConfigError, MissingExtra, OSError, ValueError) as e:  # one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    sy = cfg.syncer
    which = f"syncer shard {sy.shard} of {sy.shards}" if sy.shards > 1 else "syncer"
    log.info("%s listening at %s:%d for %d learners (round %d); workdir %s", which, server.host,
             server.port, sy.learners, server.syncer.round, workdir)  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    t = cfg.train
    while not stop.wait(0.5):
        if not cfg.syncer.stay and run_over(server.syncer, t.total_steps, t.log_every):
            log.info("every learner has finished: the syncer ends (syncer.stay=true serves on)")
            break
    log.info("syncer stopping at round %d", server.syncer.round)
    server.stop()
    if page is not None:
        page.stop()
    server.syncer.close()
    return 0
