"""JAX's persistent compilation cache, shared by runs, sweeps, resumes and processes: a second
identical command loads its compiled step from disk instead of compiling it again (issue 28).

The directory is ``train.compile_cache``, else ``$DILOCO_COMPILE_CACHE``, else
``$XDG_CACHE_HOME/diloco_jax/xla`` (``~/.cache/diloco_jax/xla``); ``off`` disables it. JAX
keys each entry by the program, the compile options, the devices and the jax/jaxlib versions,
so a changed model or layout compiles anew and never loads a stale executable.
"""

from __future__ import annotations

import collections
import os
import pathlib
import threading

import jax

ENV = "DILOCO_COMPILE_CACHE"
OFF = "off"
MIN_COMPILE_SECONDS = 0.2  # cache what takes longer to compile than to read back
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
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
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def hits() -> int:
    """Executables that the calling thread loaded from the persistent cache so far. Per thread:
    while the step compiles, another thread compiles the evaluation (``train._compile_ahead``),
    and its hits must not make a compiled step look loaded."""
    return _hits[threading.get_ident()]
