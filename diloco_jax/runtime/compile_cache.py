"""JAX's persistent compilation cache, shared by runs, sweeps, resumes and processes: a second
identical command loads its compiled step from disk instead of compiling it again (issue 28).

The directory is ``train.compile_cache``, else ``$DILOCO_COMPILE_CACHE``, else
``$XDG_CACHE_HOME/diloco_jax/xla`` (``~/.cache/diloco_jax/xla``); ``off`` disables it. JAX
keys each entry by the program, the compile options, the devices and the jax/jaxlib versions,
so a changed model or layout compiles anew and never loads a stale executable.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import logging
import os
import pathlib
import pickle
import sys
import threading
from typing import Any, NamedTuple

import jax
import numpy as np

ENV = "DILOCO_COMPILE_CACHE"
OFF = "off"
MIN_COMPILE_SECONDS = 0.2  # cache what takes longer to compile than to read back
MIN_SECONDS_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"  # JAX's own variable wins
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
log = logging.getLogger("diloco_jax")
_hits: collections.Counter = collections.Counter()  # per thread: JAX reports on the compiling one


def _on_event(event: str, **kwargs) -> None:
    if event == _HIT_EVENT:
        _hits[threading.get_ident()] += 1


jax.monitoring.register_event_listener(_on_event)


def directory(configured: str = "", environ=os.environ) -> pathlib.Path | None:
    """Where the cache lives (see the module's docstring), or None when it is off."""
    chosen = configured or environ.get(ENV, "")
    if chosen == OFF:
        return None
    if chosen:
        return pathlib.Path(chosen).expanduser()
    base = environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "diloco_jax" / "xla"


def enable(configured: str = "") -> pathlib.Path | None:
    """Points JAX's persistent cache at :func:`directory` (made if missing); returns it, or
    None when off. A directory that cannot be made leaves the cache off (a run never fails for
    it) and says why through the returned None."""
    path = directory(configured)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    minimum = float(os.environ.get(MIN_SECONDS_ENV) or MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    keep_loaded()
    return path


# ---- executables read back once per process ---------------------------------------------------
#
# Reading an executable from the cache deserializes it: about 0.2 s for each of a tiny run's
# programs on a 2-core CPU, three times per run, however often the same program is read. The
# runs of a sweep, or of a test session, trace the same programs again (each run builds its
# own closures, so JAX's in-memory caches miss) and read the same entries. The last
# ``KEEP_LOADED`` executables read are kept, by cache key, backend and devices: a program read
# again is the object read the first time. JAX shares one executable between calls the same
# way (its in-memory compile cache); the cache key covers the program and every compile option.

KEEP_LOADED = 32
_loaded: collections.OrderedDict = collections.OrderedDict()
_loaded_lock = threading.Lock()


def keep_loaded() -> None:
    """Wraps JAX's persistent-cache read with the in-process memory above (once). Where this
    JAX has no such function, nothing changes: runs read the cache as before. Newer JAX passes
    more arguments (the program's host callbacks): a read with any such argument set bypasses
    the memory, since its executable is bound to them."""
    from jax._src import compilation_cache as jax_cache

    read = getattr(jax_cache, "get_executable_and_time", None)
    if read is None or getattr(read, "keeps_loaded", False):
        return
    jax_cache.get_executable_and_time = remembering(read)


def remembering(read):
    """``read`` (JAX's ``get_executable_and_time(cache_key, compile_options, backend,
    executable_devices, ...)``) with the last :data:`KEEP_LOADED` executables it found kept in
    memory, keyed by cache key, backend and devices."""

    def get_executable_and_time(cache_key, compile_options, backend, *more, **named):
        devices = more[0] if more else named.get("executable_devices")
        extra = [*more[1:], *(v for k, v in named.items() if k != "executable_devices")]
        if devices is None or any(extra):  # not a read this memory can stand for
            return read(cache_key, compile_options, backend, *more, **named)
        key = (cache_key, id(backend), tuple(d.id for d in devices))
        with _loaded_lock:
            if key in _loaded:
                _loaded.move_to_end(key)
                return _loaded[key]
        found = read(cache_key, compile_options, backend, *more, **named)
        if found[0] is not None:
            with _loaded_lock:
                _loaded[key] = found
                while len(_loaded) > KEEP_LOADED:
                    _loaded.popitem(last=False)
        return found

    get_executable_and_time.keeps_loaded = True  # type: ignore[attr-defined]
    return get_executable_and_time


def hits() -> int:
    """Executables that the calling thread loaded from the persistent cache so far. Per thread:
    while the step compiles, another thread compiles the evaluation (``run.loop._compile_ahead``),
    and its hits must not make a compiled step look loaded."""
    return _hits[threading.get_ident()]


# ---- traced programs: a warm run skips tracing and lowering, not only XLA's compile ----------
#
# JAX's cache above keys an executable by its lowered program, so a warm run still traces and
# lowers the step (about 1.9 s of the standard workload's 2.4 s warm compile on a 2-core CPU)
# only to find the key. The step's traced program is kept too, as a ``jax.export`` artifact
# under ``PROGRAMS``, keyed by everything the trace depends on (the caller's ``material``: the
# config, the task, the data; :func:`environment`: this library's files, the versions of what
# traces, the devices, JAX's options; and the arguments' structure, shapes and shardings). A
# key that matches loads the program (~0.01 s) and lowers its call (~0.3 s); XLA's compile of
# that call then comes from JAX's cache as before. What fails before the first step (a missing,
# damaged or corrupted entry, a program that cannot be exported, lowered or compiled) falls
# back to tracing (``run.loop.compile_step``), so the cost of a failure is time, never a wrong
# program: that rests on the key, whose parts ``tests/test_program_cache.py`` checks.

PROGRAMS = "programs"  # under the cache directory, beside JAX's executables
_FORMAT = 2  # of an entry: pickle of {"format", "exported", "sha256", "in_tree", "out_tree"}


@functools.cache
def can_keep_programs() -> bool:
    """Whether ``jax.export`` can serialize here (it needs the ``flatbuffers`` package)."""
    import importlib.util

    return importlib.util.find_spec("flatbuffers") is not None


@functools.cache
def library_digest() -> str:
    """SHA-256 of every file of this package (source and shipped data), read once."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def environment() -> dict[str, Any]:
    """What a traced step depends on besides its config and arguments: this library's files,
    the Python and library versions that trace it, JAX's options and the devices."""
    import flax
    import jaxlib
    import ml_dtypes
    import optax

    versions = {m.__name__: m.__version__ for m in (jax, jaxlib, flax, optax, np, ml_dtypes)}
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    options = {k: repr(v) for k, v in jax.config.values.items()}
    flax_options = {k: repr(getattr(flax.config, k)) for k in dir(flax.config)
                    if k.startswith("flax_")}  # fmt: skip
    backend = jax.devices()[0].client
    return {"python": sys.version, "versions": versions, "library": library_digest(),
            "jax_options": options, "flax_options": flax_options, "devices": devices,
            "processes": jax.process_count(),
            "platform_version": backend.platform_version}  # fmt: skip


def describe(args) -> dict[str, Any]:
    """The arguments as a trace sees them: tree structure, shapes, dtypes, shardings."""

    def leaf(x):
        if isinstance(x, jax.Array):
            return f"{jax.typeof(x)} {x.sharding}"
        return f"{type(x).__name__} {np.shape(x)} {getattr(x, 'dtype', None)}"

    leaves, tree = jax.tree.flatten(args)
    return {"tree": str(tree), "leaves": [leaf(x) for x in leaves]}


def program_path(directory: pathlib.Path, material: dict[str, Any], args) -> pathlib.Path:
    """Where the traced program of a call with ``args`` and ``material`` is kept."""
    whole = {"format": _FORMAT, "material": material, "environment": environment(),
             "args": describe(args)}  # fmt: skip
    digest = hashlib.sha256(json.dumps(whole, sort_keys=True, default=repr).encode())
    return directory / PROGRAMS / f"{digest.hexdigest()}.jaxprog"


class Program:
    """A compiled call of an exported program, called like the function it was traced from:
    ``program(*args)``, its arguments and results the original pytrees."""

    def __init__(self, compiled, in_tree, out_tree):
        self.compiled, self.in_tree, self.out_tree = compiled, in_tree, out_tree

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten(args)
        if tree != self.in_tree:
            raise TypeError(f"arguments {tree} do not match the program's {self.in_tree}")
        return jax.tree.unflatten(self.out_tree, self.compiled(*leaves))

    def memory_analysis(self):
        return self.compiled.memory_analysis()


def _donated(args, donate_argnums: tuple[int, ...]) -> tuple[int, ...]:
    """The flat leaf indices of the positional arguments ``donate_argnums``."""
    out: list[int] = []
    start = 0
    for i, arg in enumerate(args):
        n = len(jax.tree.leaves(arg))
        if i in donate_argnums:
            out.extend(range(start, start + n))
        start += n
    return tuple(out)


class LoweredProgram(NamedTuple):
    """A call of an exported program, lowered for its arguments; ``compile()`` gives the
    :class:`Program` (XLA's compile, from JAX's cache when there), as ``Lowered.compile`` does."""

    lowered: Any
    in_tree: Any
    out_tree: Any

    def compile(self) -> Program:
        return Program(self.lowered.compile(), self.in_tree, self.out_tree)


def _lower_call(exported, args, in_tree, out_tree, donate_argnums) -> LoweredProgram:
    call = jax.jit(exported.call, donate_argnums=_donated(args, donate_argnums))
    return LoweredProgram(call.lower(*jax.tree.leaves(args)), in_tree, out_tree)


def load_program(path: pathlib.Path, args, donate_argnums=(0,)) -> LoweredProgram | None:
    """The program kept at ``path``, lowered for ``args``; None when there is none or it cannot
    be used (a damaged entry is removed)."""
    try:
        with path.open("rb") as f:
            entry = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a damaged entry costs a trace, never the run
        drop(path, e)
        return None
    try:
        if entry.get("format") != _FORMAT:
            return None
        if hashlib.sha256(entry["exported"]).hexdigest() != entry["sha256"]:
            raise ValueError("its contents do not match their checksum")
        if jax.tree.structure(args) != entry["in_tree"]:
            return None
        exported = jax.export.deserialize(bytearray(entry["exported"]))
        return _lower_call(exported, args, entry["in_tree"], entry["out_tree"], donate_argnums)
    except Exception as e:  # noqa: BLE001
        drop(path, e)
        return None


def drop(path: pathlib.Path, error: Exception) -> None:
    """Logs why the kept program at ``path`` cannot be used and removes it (where it can), so
    that the next run traces and keeps a sound one."""
    log.warning("the traced program %s could not be used (%s: %s); tracing the step",
                path, type(error).__name__, error)  # fmt: skip
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def export_program(fn, args, path: pathlib.Path | None, donate_argnums=(0,)) -> LoweredProgram:
    """``fn(*args)`` traced once, exported, kept at ``path`` (when given; a failure to write
    only logs), and lowered as :func:`load_program` lowers a kept one: a run computes the same
    bits whether it traced its step or loaded it. Raises what tracing or exporting raises (a
    caller falls back to ``fn``'s own lowering)."""
    leaves, in_tree = jax.tree.flatten(args)
    out_trees = []

    def flat(*leaves):
        out, out_tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, leaves)))
        out_trees.append(out_tree)
        return out

    exported = jax.export.export(jax.jit(flat))(*leaves)
    lowered = _lower_call(exported, args, in_tree, out_trees[-1], donate_argnums)
    if path is not None:  # kept once its call lowers: a caller drops it if it fails to compile
        blob = bytes(exported.serialize())
        entry = {"format": _FORMAT, "exported": blob, "sha256": hashlib.sha256(blob).hexdigest(),
                 "in_tree": in_tree, "out_tree": out_trees[-1]}  # fmt: skip
        _write(path, pickle.dumps(entry))
    return lowered


def _write(path: pathlib.Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all (a temporary file renamed): two processes
    writing one entry leave one of them, never a mix."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep the traced program at %s: %s", path, e)
