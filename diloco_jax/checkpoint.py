"""Orbax checkpoints of the whole train state under ``workdir/checkpoints``."""

from __future__ import annotations

import contextlib
import logging
import pathlib

import jax
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint does not fit this run, or none can be read."""


def manager(workdir: pathlib.Path, *, max_to_keep: int = 3) -> ocp.CheckpointManager:
    """Orbax manager of ``workdir/checkpoints``: saves are asynchronous and atomic (written to a
    temporary directory, renamed when complete), the last ``max_to_keep`` are kept."""
    return ocp.CheckpointManager(
        (workdir / "checkpoints").resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
    )


def save(mngr: ocp.CheckpointManager, step: int, state, *, wait: bool = True) -> None:
    """Saves ``state`` at ``step``; with ``wait=False`` the writing goes on in the background
    (the next save, or ``mngr.wait_until_finished()``, waits for it)."""
    mngr.save(step, args=ocp.args.StandardSave(state))
    if wait:
        mngr.wait_until_finished()


def _key(entry) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _shapes(tree) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key(e) for e in path): tuple(leaf.shape) for path, leaf in leaves}


def mismatch(saved: dict[str, tuple], wanted: dict[str, tuple]) -> str | None:
    """The first difference between two ``{path: shape}`` maps, in words, or None."""
    for path, shape in wanted.items():
        if path not in saved:
            return f"{path} (shape {shape}) is not in the checkpoint"
        if saved[path] != shape:
            return f"{path} has shape {saved[path]} in the checkpoint but {shape} in this run"
    extra = [p for p in saved if p not in wanted]
    return f"the checkpoint has {extra[0]}, which this run does not" if extra else None


@contextlib.contextmanager
def _quiet_absl():
    """Orbax warns through absl about files it looks for and does without; we report ourselves."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def restore_latest(mngr: ocp.CheckpointManager, like, warn=print):
    """``(state, step)`` from the newest readable checkpoint, or ``(None, None)`` if there is
    none. A checkpoint that cannot be read (truncated, corrupt) is skipped with a warning and the
    one before it is tried; one of another model raises :class:`CheckpointError` naming the first
    mismatched parameter path and both shapes. Nothing is deleted."""
    steps = sorted(mngr.all_steps(), reverse=True)
    wanted = _shapes(like)
    for step in steps:
        path = mngr.directory / str(step) / "default"
        try:
            with _quiet_absl(), ocp.StandardCheckpointer() as ckptr:
                saved = _shapes(ckptr.metadata(path).item_metadata)
        except Exception as e:  # noqa: BLE001 - any unreadable metadata means: try the previous
            warn(
                f"checkpoint {path.parent} is unreadable ({type(e).__name__}); trying the previous"
            )
            continue
        if not saved:  # orbax reads truncated metadata as an empty tree
            warn(f"checkpoint {path.parent} has no readable metadata; trying the previous")
            continue
        problem = mismatch(saved, wanted)
        if problem:
            raise CheckpointError(f"checkpoint {path.parent} does not match this run: {problem}")
        try:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
            return mngr.restore(step, args=ocp.args.StandardRestore(abstract)), step
        except Exception as e:  # noqa: BLE001 - corrupt data: fall back to the previous one
            warn(f"checkpoint {path.parent} is unreadable ({type(e).__name__}: {str(e)[:200]}); "
                 "trying the previous one")  # fmt: skip
    if steps:
        raise CheckpointError(f"no readable checkpoint in {mngr.directory} (tried steps {steps})")
    return None, None


def saved_replicas(mngr: ocp.CheckpointManager) -> int | None:
    """The replica count of the newest checkpoint (leading axis of its ``params``), if readable."""
    step = mngr.latest_step()
    if step is None:
        return None
    try:
        with _quiet_absl(), ocp.StandardCheckpointer() as ckptr:
            shapes = _shapes(ckptr.metadata(mngr.directory / str(step) / "default").item_metadata)
    except Exception:  # noqa: BLE001 - unreadable: no elastic restart
        return None
    leading = {shape[0] for path, shape in shapes.items() if path.startswith("params/") and shape}
    return leading.pop() if len(leading) == 1 else None


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
