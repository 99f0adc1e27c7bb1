"""Where a run starts: the newest readable checkpoint in its workdir (also with another replica
count: an elastic restart), or fresh parameters, possibly warm-started from an earlier run."""

from __future__ import annotations

import pathlib

import jax

from diloco_jax import checkpoint, parallel
from diloco_jax import config as config_lib
from diloco_jax.diloco import EagerDilocoState, find_anchor, find_diloco_state
from diloco_jax.reporting import log
from diloco_jax.step import init_state, state_axes


def warm_start(workdir: str, params):
    """``params`` replaced by the final outer parameters that the run in ``workdir`` exported;
    raises :class:`ConfigError` naming ``train.init_from`` if they are missing or do not fit."""
    try:
        params = checkpoint.load_params(pathlib.Path(workdir) / "params", params)
    except ValueError as e:
        raise config_lib.ConfigError(f"config key train.init_from = {workdir!r}: {e}") from None
    log.info("warm start from the final outer parameters of %s", workdir)
    return params


def resume(mngr, s, workdir: pathlib.Path):
    """The state to start from, for the run set up in ``s`` (a ``diloco_jax.train.Setup``): the
    newest readable checkpoint in ``workdir`` if there is one, else the initial state;
    a DiLoCo checkpoint with another replica count restarts elastically (:func:`elastic`)."""
    if mngr is None:
        return s.state
    try:
        restored, step = checkpoint.restore_latest(mngr, s.state, warn=log.warning)
    except checkpoint.CheckpointError:
        saved = checkpoint.saved_replicas(mngr)
        if s.cfg.algorithm != "diloco" or saved in (None, s.layout.replicas):
            raise
        return elastic(mngr, s, saved)
    if restored is None:
        return s.state
    log.info("resumed from %s at step %d", workdir / "checkpoints", step)
    return restored


def elastic(mngr, s, saved_replicas: int):
    """Resumes a checkpoint of ``saved_replicas`` replicas with this run's count: the saved
    anchor, outer state and step are kept; every replica restarts from the anchor with a fresh
    inner state (so an inner learning-rate schedule starts again)."""
    if isinstance(find_diloco_state(s.state.opt_state), EagerDilocoState):
        raise checkpoint.CheckpointError(
            f"the checkpoint has {saved_replicas} replicas, this run {s.layout.replicas}: an "
            "elastic restart needs one anchor, and with outer.mode=eager every replica has its own"
        )
    anchor = find_anchor(s.state.opt_state)
    like = jax.eval_shape(lambda: init_state(anchor, s.tx, saved_replicas))
    old = checkpoint.restore(mngr, like)
    old_diloco = find_diloco_state(old.opt_state)
    fresh = init_state(old_diloco.anchor, s.tx, s.layout.replicas)
    # the anchor, the outer state and a pending (delayed) mean are shared: they carry over
    opt_state = fresh.opt_state._replace(
        step=old_diloco.step, outer_state=old_diloco.outer_state, pending=old_diloco.pending
    )
    state = fresh._replace(step=old.step, opt_state=opt_state)
    log.warning(
        "elastic restart at step %d: the checkpoint has %d replicas, this run %d; every replica "
        "restarts from the saved anchor with a fresh inner state (outer state kept)",
        int(old.step), saved_replicas, s.layout.replicas,
    )  # fmt: skip
    return parallel.place(state, state_axes(state), s.mesh)
