"""Orbax checkpoints of the whole train state under ``workdir/checkpoints``.

Layout (schema :data:`SCHEMA_VERSION` = 2): ``checkpoints/<step>/state`` holds the train state
(``StandardSave``) and ``checkpoints/<step>/meta`` a JSON object ``{"schema_version": 2,
"config": {...}}`` with the resolved config that trained it (and, for a user's grain
pipelines, ``data``: each replica's iterator state, :mod:`diloco_jax.tasks.pipeline`); orbax
writes both into one temporary directory and renames it when complete, so they are saved
atomically together. Schema 1 (before the config was saved) held only the state, under
``checkpoints/<step>/default``.

Every read settles orbax's work before it returns (:func:`_settled`): a damaged checkpoint is
reported in one line, never followed by tracebacks of reads it left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import orbax.checkpoint as ocp

SCHEMA_VERSION = 2
_STATE, _META = "state", "meta"  # the items of a checkpoint step directory
_LEGACY_STATE = "default"  # schema 1: the state alone, as orbax's unnamed item


class CheckpointError(ValueError):
    """A checkpoint does not fit this run, or none can be read."""


class SchemaError(CheckpointError):
    """A checkpoint written by another version of diloco-jax (not a damaged one)."""


class MismatchError(CheckpointError):
    """The checkpoint at ``step`` holds parameters of other shapes than this run's."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class Restored(NamedTuple):
    state: Any
    step: int
    config: dict  # the resolved config that wrote the checkpoint (``config.to_dict``)
    controls: dict = {}  # what was changed while it ran (``{"outer_lr": 0.35}``; serve.py)
    data: dict | None = None  # each replica's pipeline state (a user's GrainTask), or None


class _StateHandler(ocp.StandardCheckpointHandler):
    """orbax's ``StandardCheckpointHandler``, the same on disk, that writes each array from the
    first device holding it rather than split over every device holding a copy (orbax's
    "replica-parallel" saving, its default off GPU). Splitting compiled a slice per array
    shape and device on each process's first save, 0.6-1.2 s of a short run's end on a CPU,
    to share writes of a few MiB. If the orbax installed lacks the parts used here, orbax's
    own handler is kept."""

    def __init__(self):
        super().__init__()
        try:
            from orbax.checkpoint._src.metadata import array_metadata_store

            arrays = ocp.type_handlers.ArrayHandler(
                use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()
            )
            handlers = [(t, arrays if t is jax.Array else ocp.type_handlers.get_type_handler(t))
                        for t in ocp.type_handlers.supported_types()]  # fmt: skip
            registry = ocp.type_handlers.create_type_handler_registry(*handlers)
            self._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
        except (ImportError, AttributeError, TypeError, ValueError):
            pass


@ocp.args.register_with_handler(_StateHandler, for_save=True)
class _StateSave(ocp.args.StandardSave):
    """``StandardSave`` through :class:`_StateHandler`."""


@ocp.args.register_with_handler(_StateHandler, for_restore=True)
class _StateRestore(ocp.args.StandardRestore):
    """``StandardRestore`` through :class:`_StateHandler`."""


def manager(workdir: pathlib.Path, *, max_to_keep: int = 3) -> ocp.CheckpointManager:
    """Orbax manager of ``workdir/checkpoints``: saves are asynchronous and atomic (written to a
    temporary directory, renamed when complete), the last ``max_to_keep`` are kept."""
    handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state, meta = _StateHandler(), ocp.JsonCheckpointHandler()
    for args, handler in ((_StateSave, state), (_StateRestore, state),
                          (ocp.args.JsonSave, meta), (ocp.args.JsonRestore, meta)):  # fmt: skip
        handlers.add(_STATE if handler is state else _META, args, handler)
    return ocp.CheckpointManager(
        (workdir / "checkpoints").resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        handler_registry=handlers,
    )


def save(mngr: ocp.CheckpointManager, step: int, state, config: dict, *, wait: bool = True,
         controls: dict | None = None, data: dict | None = None):  # fmt: skip
    """Saves ``state`` at ``step`` with ``config`` (the resolved config as a JSON-able dict) and
    ``controls`` (what was changed while the run ran, e.g. ``{"outer_lr": 0.35}``); with
    ``wait=False`` the writing goes on in the background (the next save, or
    ``mngr.wait_until_finished()``, waits for it). ``data``: the data pipelines' states at
    ``step`` (``{replica: state}``, every process's), saved with the rest."""
    meta = {"schema_version": SCHEMA_VERSION, "config": config, "controls": controls or {}}
    if data is not None:
        meta["data"] = data
    items = {_STATE: _StateSave(state), _META: ocp.args.JsonSave(meta)}
    mngr.save(step, args=ocp.args.Composite(**items))
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


# Orbax runs each read in an event loop of its own (``asyncio_utils.run_sync``) and closes it as
# soon as one read fails, with the others still pending: they fail later, on a closed loop, and
# write their tracebacks to stderr at garbage collection ("Task exception was never retrieved",
# "Event loop is closed", "Exception ignored in: <coroutine ...>"), long after the damage was
# reported. While :func:`_settled` is entered, such a loop lets them end first.
_SETTLE_S = 60.0  # the longest wait for them (a read that hangs is cancelled after it)
_settling = threading.RLock()  # the event loop policy is the process's: one swap at a time


class _SettlingLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``close`` first lets the tasks still on it end (at most
    :data:`_SETTLE_S` seconds, then cancels them) and takes their results, errors included."""

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            self.run_until_complete(self._settle())
        super().close()

    async def _settle(self) -> None:
        # callbacks queued as the loop stopped run first: a gather marks its late children's
        # errors as seen there
        await asyncio.sleep(0)
        left = asyncio.all_tasks(self) - {asyncio.current_task()}
        if left:
            _, hung = await asyncio.wait(left, timeout=_SETTLE_S)
            for task in hung:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)


class _SettlingPolicy(asyncio.DefaultEventLoopPolicy):
    """asyncio's own policy, but that its new event loops are :class:`_SettlingLoop`."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _SettlingLoop()


@contextlib.contextmanager
def _settled():
    """Every event loop made inside (orbax's) is a :class:`_SettlingLoop`: the reads of a
    checkpoint have all ended when the call that made them returns or raises."""
    with _settling:
        before = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(_SettlingPolicy())
        try:
            yield
        finally:
            asyncio.set_event_loop_policy(before)


def described(error: BaseException, limit: int = 200) -> str:
    """``error`` in one line: its type and the start of its message (orbax's span lines), or
    its first cause's (orbax's error reading an array holds tensorstore's reason as its cause)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}" if text else type(error).__name__


def _check_schema(path: pathlib.Path, version) -> None:
    if version != SCHEMA_VERSION:
        age = "another"
        if isinstance(version, int):
            age = "an older" if version < SCHEMA_VERSION else "a newer"
        raise SchemaError(
            f"checkpoint {path} was written by {age} version of diloco-jax (schema {version}, "
            f"this is {SCHEMA_VERSION}); continue it with that version, or start a new --workdir"
        )


def _read(mngr: ocp.CheckpointManager, step: int) -> tuple[dict[str, tuple], dict]:
    """The ``{path: shape}`` map of the state saved at ``step`` and its metadata (``config``,
    ``controls``); raises
    :class:`CheckpointError` for a checkpoint of another schema, anything else if unreadable."""
    path = mngr.directory / str(step)
    if (path / _LEGACY_STATE).is_dir() and not (path / _META).exists():
        _check_schema(path, 1)
    with _quiet_absl(), _settled():
        meta = mngr.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
        with ocp.StandardCheckpointer() as ckptr:
            shapes = _shapes(ckptr.metadata(path / _STATE).item_metadata)
    meta = meta[_META]
    _check_schema(path, meta.get("schema_version") if isinstance(meta, dict) else None)
    return shapes, meta


_T = TypeVar("_T")


def newest_readable(
    mngr: ocp.CheckpointManager,
    read: Callable[[int], _T],
    report: Callable[[int, Exception, int | None], None],
    *,
    fatal: tuple[type[Exception], ...] = (CheckpointError,),
) -> _T | None:
    """``read(step)`` of the newest checkpoint it can read, trying the steps from the newest
    down; None where there is none. An error of a ``fatal`` type is raised; any other means
    damage: the step before is tried, and once the outcome is known each damaged step is
    reported, ``report(step, error, started)`` (``started``: the step read instead, None where
    none was). With none readable, raises :class:`CheckpointError`. Nothing is deleted.

    The run's resume (:func:`restore_latest`) and the syncer's (``learners.store``) both fall
    back through this."""
    steps = sorted(mngr.all_steps(), reverse=True)
    damaged: list[tuple[int, Exception]] = []
    started = None
    try:
        for step in steps:
            try:
                got = read(step)
            except fatal:
                raise
            except Exception as e:  # noqa: BLE001 - any damage: try the one before
                damaged.append((step, e))
                continue
            started = step
            return got
        if steps:
            raise CheckpointError(
                f"no readable checkpoint in {mngr.directory} (tried steps {steps})"
            )
        return None
    finally:  # one line for each, naming where it went on from
        for step, error in damaged:
            report(step, error, started)


def restore_latest(mngr: ocp.CheckpointManager, like, warn=print) -> Restored | None:
    """The newest readable checkpoint as :class:`Restored`, or None if there is none. One that
    cannot be read (truncated, corrupt) is skipped, named in one line (``warn``) with the step
    restored instead; one of another model raises :class:`MismatchError` naming the first
    mismatched parameter path and both shapes, one of another schema :class:`CheckpointError`.
    Nothing is deleted."""

    def read(step: int) -> Restored:
        saved, meta = _read(mngr, step)
        if not saved:  # orbax reads truncated metadata as an empty tree
            raise ValueError("no readable metadata")
        _fits(mngr.directory / str(step), step, saved, like)
        state = _restore_state(mngr, like, step)
        return Restored(state, step, meta["config"], meta.get("controls", {}), meta.get("data"))

    def report(step: int, error: Exception, started: int | None) -> None:
        then = ("no checkpoint before it was restored" if started is None
                else f"restored step {started} instead")  # fmt: skip
        warn(f"checkpoint {mngr.directory / str(step)} is unreadable ({described(error)}); {then}")

    return newest_readable(mngr, read, report)


def saved_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    """The metadata saved with the checkpoint at ``step`` (``config``, ``controls``); raises
    :class:`CheckpointError` if it is of another schema or unreadable."""
    try:
        return _read(mngr, step)[1]
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - reported in one line
        raise CheckpointError(
            f"checkpoint {mngr.directory / str(step)} is unreadable ({type(e).__name__})"
        ) from None


def saved_replicas(mngr: ocp.CheckpointManager, step: int) -> int | None:
    """The replica count of the checkpoint at ``step`` (leading axis of its ``params``), if
    readable."""
    try:
        shapes = _read(mngr, step)[0]
    except Exception:  # noqa: BLE001 - unreadable: no elastic restart
        return None
    leading = {shape[0] for path, shape in shapes.items() if path.startswith("params/") and shape}
    return leading.pop() if len(leading) == 1 else None


def differing(mngr: ocp.CheckpointManager, step: int, like) -> set[str]:
    """The paths (``outer_state/0/0/count``) whose shapes, or presence, differ between the
    checkpoint at ``step`` and ``like``."""
    saved, wanted = _read(mngr, step)[0], _shapes(like)
    return {p for p in saved.keys() | wanted.keys() if saved.get(p) != wanted.get(p)}


def _fits(path: pathlib.Path, step: int, saved: dict[str, tuple], like) -> None:
    problem = mismatch(saved, _shapes(like))
    if problem:
        raise MismatchError(f"checkpoint {path} does not match this run: {problem}", step)


def _restore_state(mngr: ocp.CheckpointManager, like, step: int):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    args = ocp.args.Composite(**{_STATE: _StateRestore(abstract)})
    with _settled():
        return mngr.restore(step, args=args)[_STATE]


def restore(mngr: ocp.CheckpointManager, like, step: int | None = None):
    """Restores the state saved at ``step`` (latest by default) into the structure, shapes,
    dtypes and shardings of ``like``; raises :class:`MismatchError` if its shapes differ, and
    :class:`CheckpointError` if it is of another schema."""
    step = mngr.latest_step() if step is None else step
    _fits(mngr.directory / str(step), step, _read(mngr, step)[0], like)
    return _restore_state(mngr, like, step)


def save_params(path: pathlib.Path, params) -> None:
    """Writes ``params`` (e.g. the final outer parameters) as a standalone orbax checkpoint."""
    path = path.resolve()
    with ocp.AsyncCheckpointer(_StateHandler()) as ckptr:
        ckptr.save(path, args=_StateSave(params), force=True)


def load_params(path: pathlib.Path, like):
    """Reads parameters written by :func:`save_params` into the structure of ``like``; raises
    ``ValueError`` naming the path if they are missing or do not fit."""
    path = path.resolve()
    if not path.is_dir():
        raise ValueError(f"no saved parameters at {path}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    with ocp.StandardCheckpointer() as ckptr, _settled():
        try:
            return ckptr.restore(path, abstract)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"parameters at {path} do not fit this model: {e}") from None
