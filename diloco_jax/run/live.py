"""The training loop's side of :mod:`diloco_jax.watch.serve`: the server started from the
config, the run's events fed to its board, and the actions asked over HTTP agreed by every
process at a call boundary (process 0 serves; the others follow its answer, as they follow a
preemption).

The outer learning rate set over HTTP (``POST /control/outer_lr``) reaches the step as a scale
of the outer update (``StepControl.outer_scale``: an input of the compiled call, so nothing is
recompiled), applies from the next sync on, is written to ``metrics.jsonl`` (a ``control``
event), saved with every checkpoint (``controls``) and taken up again on resume.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.run import distributed
from diloco_jax.simulated import comms
from diloco_jax.watch import serve
from diloco_jax.watch.reporting import log


def _bytes_per_sync(cfg: config_lib.Config, params, replicas: int) -> float:
    """Bytes each replica sends in one DiLoCo sync: its pseudo-gradient, as the config's codec
    encodes it, every replica taking part (a fragment's, on average, when streaming;
    :func:`~diloco_jax.config.recipe.sync_payloads`); 0 for the baselines, whose reduces are not
    syncs."""
    from diloco_jax.config.recipe import sync_payloads

    if cfg.algorithm != "diloco":
        return 0.0
    payloads, topology = sync_payloads(cfg, params, replicas)
    sent = [comms.bytes_per_replica(p, replicas, topology) for p in payloads]
    return sum(sent) / len(sent)


def bind(
    cfg: config_lib.Config, board: serve.Board, controls: serve.Controls, token: str
) -> serve.Server:
    """The server on ``serve.host:serve.port``; a port it cannot have is a one-line
    :class:`~diloco_jax.config.ConfigError` (before anything is compiled)."""
    host, port = cfg.serve.host, cfg.serve.port
    try:
        return serve.Server(host, port, board=board, controls=controls, token=token)
    except OSError as e:
        raise config_lib.ConfigError(
            f"config key serve.port = {port} is invalid: cannot serve on {host}:{port} "
            f"({e.strerror or e}); choose a free port"
        ) from None


class Live:
    """The server of a run, its board and its controls; :meth:`agree` after each call.

    ``controls``: what the checkpoint the run resumes from was changed by (``outer_lr``);
    ``server``: a sweep's server, which shows this run's board while it runs (else the run
    starts its own)."""

    def __init__(self, cfg: config_lib.Config, s, workdir: pathlib.Path, *, lead: bool,
                 controls: dict | None = None, server: serve.Server | None = None):  # fmt: skip
        self.server, self.board = None, None
        self.controls = serve.Controls()
        self.enabled = cfg.serve.port > 0
        self.base_lr = cfg.outer.learning_rate if cfg.algorithm == "diloco" else None
        self.outer_lr = (controls or {}).get("outer_lr", self.base_lr)
        if self.outer_lr != self.base_lr:
            log.info("outer learning rate %g, as set over HTTP before the checkpoint",
                     self.outer_lr)  # fmt: skip
        if not (lead and self.enabled):
            return
        replicas = s.layout.replicas
        self.board = serve.Board(
            config=config_lib.to_dict(cfg), total_steps=cfg.train.total_steps,
            replicas=replicas, unit=s.unit,
            tokens_per_step=replicas * cfg.data.batch_size * s.tokens_per_row,
            bytes_per_sync=_bytes_per_sync(cfg, jax.eval_shape(s.outer_fn, s.state), replicas),
            outer_lr=self.outer_lr,
        )  # fmt: skip
        if server is not None:  # a sweep's: it outlives this run
            server.controls.take()  # asked between runs: about none of them
            self.controls, server.board = server.controls, self.board
            return
        token, generated = serve.resolve_token(cfg.serve.token_file, workdir)
        self.server = bind(cfg, self.board, self.controls, token)
        self.server.start()
        where = f"http://{cfg.serve.host}:{self.server.port}/"
        told = f"; control token in {workdir / 'serve_token'}" if generated else ""
        log.info("serving the dashboard, /status and /metrics at %s%s", where, told)

    @property
    def outer_scale(self) -> float:
        """The outer update's scale: the outer learning rate in effect over the config's."""
        if self.base_lr is None or self.outer_lr is None:  # not DiLoCo: no outer step
            return 1.0
        return self.outer_lr / self.base_lr

    @property
    def changed(self) -> dict:
        """What the checkpoints keep: ``{"outer_lr": value}`` once it was changed."""
        return {} if self.outer_lr == self.base_lr else {"outer_lr": self.outer_lr}

    def agree(self, runlog, stop, step: int) -> dict:
        """The actions asked over HTTP since the last call, as process 0's server got them
        (``{action: value}``), done here where they are the loop's own (the outer learning
        rate; a stop, taken as a signal is: ``stop`` is the run's
        :class:`~diloco_jax.run.preemption.Preemption`) and logged (``metrics.jsonl``: a ``control``
        event). Every process calls this after every call; with ``serve.port`` (the same
        everywhere) they agree in one tiny broadcast."""
        if not self.enabled:
            return {}
        asked = self.controls.take()
        lr_bits = np.array([asked.get("outer_lr", 0.0)], np.float64).view(np.int32)  # exact
        flags = distributed.from_lead([int(a in asked) for a in serve.ACTIONS] + list(lr_bits))
        agreed: dict[str, Any] = {a: True for a, f in zip(serve.ACTIONS, flags, strict=False) if f}
        if "outer_lr" in agreed:
            lr = np.array(flags[len(serve.ACTIONS) :], np.int32).view(np.float64)[0]
            agreed["outer_lr"] = self.outer_lr = float(lr)
        for action, value in sorted(agreed.items()):
            said = "" if value is True else f" = {value:g}"
            log.info("step %d: %s%s asked over HTTP (POST /control/%s)", step, action, said,
                     action)  # fmt: skip
        if agreed:
            lr_now = {"outer_lr": self.outer_lr} if "outer_lr" in agreed else {}
            runlog.write("control", step, actions=sorted(agreed), **lr_now)
        if "stop" in agreed and stop.requested is None:
            stop.requested = "POST /control/stop"
        return agreed

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
