"""Orbax checkpoints of the whole train state under ``workdir/checkpoints``."""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


def manager(workdir: pathlib.Path, *, max_to_keep: int = 3) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        (workdir / "checkpoints").resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
    )


def save(mngr: ocp.CheckpointManager, step: int, state) -> None:
    """Saves ``state`` at ``step`` and waits until it is committed."""
    mngr.save(step, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()


def restore(mngr: ocp.CheckpointManager, like, step: int | None = None):
    """Restores the checkpoint at ``step`` (latest by default) into the structure, shapes, dtypes
    and shardings of ``like``."""
    step = mngr.latest_step() if step is None else step
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    return mngr.restore(step, args=ocp.args.StandardRestore(abstract))
