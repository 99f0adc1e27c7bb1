"""Where a run's traced step is kept (issue 28): the part of a config, and of its data, that the
traced step depends on, which keys the kept program (``runtime/compile_cache.py``: ``jax.export``
artifacts beside JAX's executables) together with the library, the versions, the devices and
the arguments; and the step lowered from the kept program, traced and kept, or lowered by JAX
alone. ``diloco_jax.train`` uses it; ``tests/test_program_cache.py`` checks its keys."""

from __future__ import annotations

import pathlib

import jax

from diloco_jax import config as config_lib
from diloco_jax.config import recipe
from diloco_jax.runtime import compile_cache
from diloco_jax.watch.reporting import log

# Config keys the traced step does not depend on (tests/test_program_cache.py lowers the step
# with them changed and finds the same program): runs that differ only in them load one kept
# traced program. See free_keys for the configs where the set differs.
PROGRAM_FREE = (
    "seed",  # an input of the step (StepControl.seed)
    "train.eval_every", "train.checkpoint", "train.checkpoint_every",
    "train.checkpoint_minutes", "train.keep_checkpoints",
    "train.sample_chars", "train.sample_prompt", "train.compile_cache",
    "train.check_replicated", "data.eval_windows",
    "sim.network", "sim.bandwidth_gbps", "sim.latency_ms", "sim.topology", "sim.step_time_s",
    "log.progress_bar", "log.figures", "log.wandb", "log.wandb_project", "log.wandb_mode",
    "serve.port", "serve.host", "serve.token_file",
)  # fmt: skip


def free_keys(cfg: config_lib.Config) -> set[str]:
    """:data:`PROGRAM_FREE` for ``cfg``: with ``outer.learning_rate`` where it is an input of the
    step, without ``seed`` under NoLoCo (its pairings are drawn from the seed as the step is
    built: constants in it) or an attack (its hostile replicas and noise, likewise)."""
    free = set(PROGRAM_FREE)
    if recipe.outer_lr_is_input(cfg):
        free.add("outer.learning_rate")
    if recipe.gossip_of(cfg) is not None or recipe.attack_of(cfg).active:
        free.discard("seed")  # the pairings, or the hostile replicas, drawn from it
    return free


def material(cfg: config_lib.Config) -> dict | None:
    """What the traced step of a built-in task depends on in ``cfg`` (its keys but
    :func:`free_keys`'s) and in the data (a corpus file's path, size and modification time;
    the shipped corpora are part of the library's digest); None where the step is not kept as a
    traced program: a user's task or optimizer (its code is not in the key), a TFDS dataset, several
    processes, a GPU or TPU (not yet checked there), no cache."""
    custom = any(":" in c.optimizer for c in (cfg.inner, cfg.outer))
    eligible = (not cfg.task.factory and not custom and not cfg.data.corpus.startswith("tfds:")
                and jax.process_count() == 1 and jax.default_backend() == "cpu"
                and compile_cache.directory(cfg.train.compile_cache) is not None
                and compile_cache.can_keep_programs())  # fmt: skip
    if not eligible:
        return None
    free = free_keys(cfg)
    keys = {k: v for k, v in config_lib.keys(cfg).items() if k not in free}
    corpus = pathlib.Path(cfg.data.corpus).expanduser()
    data = None
    if corpus.is_file():
        st = corpus.stat()
        data = (str(corpus.resolve()), st.st_size, st.st_mtime_ns)
    return {"config": keys, "corpus": data}


def lower(s, args, material: dict | None):
    """The step lowered for ``args``; how ("loaded": the kept traced program, "traced": traced
    and kept, "lowered": JAX's own lowering, where nothing is kept); and the kept program's
    path (None where nothing is kept)."""
    if material is not None and hasattr(s.run_chunk, "trace"):  # one jitted call, not chunked
        directory = compile_cache.directory(s.cfg.train.compile_cache)
        assert directory is not None  # material() is None without a cache
        path = compile_cache.program_path(directory, material, args)
        kept = compile_cache.load_program(path, args)
        if kept is not None:
            return kept, "loaded", path
        try:
            return compile_cache.export_program(s.run_chunk, args, path), "traced", path
        except Exception as e:  # noqa: BLE001 - only time is at stake
            log.warning("the step could not be kept as a traced program (%s: %s)",
                        type(e).__name__, e)  # fmt: skip
    return s.run_chunk.lower(*args), "lowered", None
