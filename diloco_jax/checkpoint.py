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


def save_params(path: pathlib.Path, params) -> None:
    """Writes ``params`` (e.g. the final outer parameters) as a standalone orbax checkpoint."""
    path = path.resolve()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params, force=True)


def load_params(path: pathlib.Path, like):
    """Reads parameters written by :func:`save_params` into the structure of ``like``; raises
    ``ValueError`` naming the path if they are missing or do not fit."""
    path = path.resolve()
    if not path.is_dir():
        raise ValueError(f"no saved parameters at {path}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            return ckptr.restore(path, abstract)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"parameters at {path} do not fit this model: {e}") from None
