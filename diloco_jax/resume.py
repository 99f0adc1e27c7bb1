"""Where a run starts: the newest readable checkpoint in its workdir (also with another replica
count: an elastic restart), or fresh parameters, possibly warm-started from an earlier run."""

from __future__ import annotations

import pathlib

import jax

from diloco_jax import checkpoint, parallel
from diloco_jax import config as config_lib
from diloco_jax.algorithm import PER_REPLICA, init_replicas
from diloco_jax.algorithm import state as state_lib
from diloco_jax.reporting import log


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
    """Resumes a checkpoint of ``saved_replicas`` replicas with this run's count: the shared
    fields (step, anchor, outer state, a pending mean: as the algorithm's kinds declare) are
    kept; every replica restarts from the anchor with a fresh inner state (so an inner
    learning-rate schedule starts again)."""
    algorithm, kinds = s.algorithm, s.algorithm.kinds
    if kinds.anchor == PER_REPLICA:
        raise checkpoint.CheckpointError(
            f"the checkpoint has {saved_replicas} replicas, this run {s.layout.replicas}: an "
            "elastic restart needs one anchor, and with outer.mode=eager every replica has its own"
        )
    anchor = s.state.anchor
    like = jax.eval_shape(lambda: init_replicas(algorithm, anchor, saved_replicas))
    old = checkpoint.restore(mngr, like)
    fresh = init_replicas(algorithm, old.anchor, s.layout.replicas)
    state = state_lib.replace_shared(fresh, kinds, old)
    log.warning(
        "elastic restart at step %d: the checkpoint has %d replicas, this run %d; every replica "
        "restarts from the saved anchor with a fresh inner state (outer state kept)",
        int(old.step), saved_replicas, s.layout.replicas,
    )  # fmt: skip
    return parallel.place(state, kinds, s.mesh)
