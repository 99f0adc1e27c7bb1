"""Where a run starts: the newest readable checkpoint in its workdir (also with another replica
count: an elastic restart), or fresh parameters, possibly warm-started from an earlier run.

A checkpoint carries the config that trained it. A resume must not silently change the training:
every key except :data:`MAY_CHANGE` must equal the checkpoint's, or the run stops with one line
naming the key and both values (``allow_config_change`` resumes anyway, logging each change).
The workdir keeps ``config.json`` (the config of its first start, never rewritten) and
``config_history.jsonl`` (one line per later start: :func:`record`).
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any, NamedTuple

import jax

from diloco_jax import config as config_lib
from diloco_jax.algorithm import PER_REPLICA, init_replicas
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import recipe, user_optimizers
from diloco_jax.runtime import checkpoint, parallel
from diloco_jax.watch.reporting import log

# The keys a resume may change: they leave the training computation (every step's parameters)
# and the meaning of the logged numbers as they were. Every other key changes the training (the
# model, the data and its order, the optimizers and their schedules over train.total_steps, the
# sync and its variants, the simulated stragglers and failures, the seed) or what its evaluation
# measures (data.eval_windows, data.eval_split), so it must equal the checkpoint's.
MAY_CHANGE = (
    "parallel.replicas",  # an elastic restart (:func:`elastic`) says what it changes
    # every layout computes the same algorithm
    "parallel.runtime", "parallel.replica_devices", "parallel.data_devices", "parallel.cpu_devices",
    "parallel.device_memory_gib", "parallel.fsdp", "sim.chunk", "sim.offload",
    # steps per compiled call: the same steps cut into other calls (the run stops at the first
    # call boundary, counted from the resumed step, at or past train.total_steps rounded up to
    # whole calls)
    "train.log_every",
    "train.eval_every", "train.checkpoint", "train.checkpoint_every",
    "train.checkpoint_minutes", "train.keep_checkpoints",
    "train.sample_chars", "train.sample_prompt",
    "train.init_from",  # read by a fresh start only
    "train.compile_cache",  # where compiled steps are kept: the same executables
    "model.remat",  # memory only: the same gradients up to rounding
    "data.data_dir",  # where the dataset lives, not which one it is
    "data.max_memory_mib",  # streamed or loaded: the same batches
    # the simulated clock and a logged statistic
    "sim.network", "sim.bandwidth_gbps", "sim.latency_ms", "sim.topology", "sim.step_time_s",
    "sim.diagnostics",
    "train.check_replicated",  # a debug check of the same computation
    "train.deterministic",  # a GPU's summation order: the same steps up to rounding
    # where the same numbers are shown: the progress bar, Weights & Biases
    "log.progress_bar", "log.figures", "log.wandb", "log.wandb_project", "log.wandb_mode",
    "serve.port", "serve.host", "serve.token_file",  # the run's HTTP view of itself
)  # fmt: skip


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()  # a key one of two configs does not have


class Start(NamedTuple):
    """Where a run starts: its state, the step, the checkpoint directory (None: from scratch)
    and the config keys that differ from the checkpoint's, ``{key: (saved, now)}``, and what was
    changed while it ran (``controls``, e.g. ``{"outer_lr": 0.35}``:
    :mod:`diloco_jax.watch.serve`)."""

    state: Any
    step: int
    checkpoint: pathlib.Path | None = None
    changes: dict[str, tuple] = {}
    controls: dict = {}
    data: dict | None = None  # the data pipelines' states at ``step`` (None: from their start)


def warm_start(workdir: str, params):
    """``params`` replaced by the final outer parameters that the run in ``workdir`` exported;
    raises :class:`ConfigError` naming ``train.init_from`` if they are missing or do not fit."""
    try:
        params = checkpoint.load_params(pathlib.Path(workdir) / "params", params)
    except ValueError as e:
        raise config_lib.ConfigError(f"config key train.init_from = {workdir!r}: {e}") from None
    log.info("warm start from the final outer parameters of %s", workdir)
    return params


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def config_changes(saved: dict, cfg: config_lib.Config) -> dict[str, tuple]:
    """``{key: (saved value, cfg's value)}`` for every key whose values differ, in config order;
    ``saved`` is a ``config.to_dict``. A key that ``saved`` lacks (added to diloco-jax later)
    counts as its default; one that ``cfg`` lacks is :data:`ABSENT`."""
    now = config_lib.keys(cfg)
    before = {**config_lib.keys(config_lib.Config()), **_flat(saved)}
    return {
        key: (before.get(key, ABSENT), now.get(key, ABSENT))
        for key in [*now, *(k for k in before if k not in now)]
        if before.get(key, ABSENT) != now.get(key, ABSENT)
    }


def check_config(cfg: config_lib.Config, saved: dict, path: pathlib.Path, *,
                 allow_change: bool) -> dict[str, tuple]:  # fmt: skip
    """The changes of ``cfg`` against ``saved``, the config of the checkpoint at ``path``; raises
    :class:`ConfigError` naming the first key outside :data:`MAY_CHANGE` that differs and both
    values, unless ``allow_change``, which logs each such change instead."""
    changes = config_changes(saved, cfg)
    locked = [key for key in changes if key not in MAY_CHANGE]
    if locked and not allow_change:
        (old, new), others = changes[locked[0]], locked[1:]
        also = f"; {', '.join(others)} also differ" if others else ""
        raise config_lib.ConfigError(
            f"config key {locked[0]} = {new!r} differs from the checkpoint's {old!r} ({path}"
            f"{also}); pass --allow_config_change (from Python: allow_config_change=True) to "
            "resume with the new value"
        )
    if locked:
        listed = ", ".join(f"{k} {changes[k][0]!r} -> {changes[k][1]!r}" for k in locked)
        log.warning("resuming %s with a changed config (--allow_config_change): %s", path, listed)
    return changes


def resume(mngr, s, workdir: pathlib.Path, *, allow_config_change: bool = False) -> Start:
    """Where the run set up in ``s`` (a ``diloco_jax.run.setup.Setup``) starts: the newest readable
    checkpoint in ``workdir`` if there is one (its config checked by :func:`check_config`), else
    the initial state; a DiLoCo checkpoint with another replica count restarts elastically
    (:func:`elastic`)."""
    if mngr is None:
        return Start(s.state, 0)
    try:
        restored = checkpoint.restore_latest(mngr, s.state, warn=log.warning)
    except checkpoint.MismatchError as e:
        if s.cfg.algorithm == "diloco" and all(
            p.startswith("outer_state/") for p in checkpoint.differing(mngr, e.step, s.state)
        ):  # another outer optimizer, if an outer.* key changed
            started = new_outer(mngr, s, e.step, allow_config_change)
            if started is not None:
                return started
        saved = checkpoint.saved_replicas(mngr, e.step)
        if s.cfg.algorithm != "diloco" or saved in (None, s.layout.replicas):
            raise
        path, meta = mngr.directory / str(e.step), checkpoint.saved_meta(mngr, e.step)
        changes = check_config(s.cfg, meta["config"], path, allow_change=allow_config_change)
        return Start(elastic(mngr, s, saved, e.step), e.step, path, changes,
                     meta.get("controls", {}))  # fmt: skip
    if restored is None:
        where = workdir / "checkpoints"
        if (workdir / "config.json").exists():  # started before: stopped before any save
            log.warning("no checkpoint in %s: starting from step 0 (this workdir's earlier "
                        "start saved none)", where)  # fmt: skip
        else:
            log.info("no checkpoint in %s: starting from step 0", where)
        return Start(s.state, 0)
    path = mngr.directory / str(restored.step)
    changes = check_config(s.cfg, restored.config, path, allow_change=allow_config_change)
    log.info("resumed from %s at step %d", workdir / "checkpoints", restored.step)
    return Start(restored.state, restored.step, path, changes, restored.controls, restored.data)


def record(workdir: pathlib.Path, cfg: config_lib.Config, start: Start) -> None:
    """Writes ``workdir/config.json`` at the workdir's first start; every later start appends
    one line to ``workdir/config_history.jsonl``: ``time``, ``step`` (where it starts),
    ``checkpoint`` (the directory resumed, or null: from scratch), ``changes`` (``{key: [old,
    new]}`` against the checkpoint's config, or else config.json's), ``overridden`` (the changed
    keys outside :data:`MAY_CHANGE`) and the full ``config``."""
    workdir.mkdir(parents=True, exist_ok=True)
    config, first = config_lib.to_dict(cfg), workdir / "config.json"
    if start.checkpoint is None and not first.exists():
        first.write_text(json.dumps(config, indent=2) + "\n")
        return
    changes = start.changes
    if start.checkpoint is None:  # no checkpoint was kept: compare with the first start
        changes = config_changes(json.loads(first.read_text()), cfg)
    plain = {k: [None if v is ABSENT else v for v in pair] for k, pair in changes.items()}
    entry = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "step": start.step,
        "checkpoint": None if start.checkpoint is None else str(start.checkpoint),
        "changes": plain,
        "overridden": [k for k in changes if k not in MAY_CHANGE],
        "config": config,
    }
    with open(workdir / "config_history.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def new_outer(mngr, s, step: int, allow_config_change: bool) -> Start | None:
    """Resumes the checkpoint at ``step``, saved with another outer optimizer (its state of
    other shapes), where ``allow_config_change``: everything is kept but the outer optimizer's
    state, which starts afresh (its momentum lost). Otherwise, or when the outer optimizers were
    given from Python (no config says what the saved one was), or under ``outer.mode=eager``,
    raises one line naming it. None where no ``outer.*`` key changed (the mismatch is another)."""
    path, meta = mngr.directory / str(step), checkpoint.saved_meta(mngr, step)
    outer = {k for k in config_changes(meta["config"], s.cfg) if k.startswith("outer.")}
    if not outer:
        return None
    changes = check_config(s.cfg, meta["config"], path, allow_change=allow_config_change)
    given = [v for k in outer for v in changes[k] if str(v).startswith(user_optimizers.GIVEN)]
    if given or s.algorithm.kinds.anchor == PER_REPLICA:
        why = ("with outer.mode=eager every replica has its own" if not given else
               "an optimizer given from Python has no config to rebuild its")  # fmt: skip
        raise checkpoint.CheckpointError(
            f"checkpoint {path} holds the state of another outer optimizer (outer.optimizer "
            f"{meta['config']['outer']['optimizer']!r}) and {why} state: resume with that one, "
            "or start a new --workdir")  # fmt: skip
    saved_cfg = s.cfg  # the saved run's config, as far as its outer state's shapes go
    for key, (old, _) in changes.items():
        if old is not ABSENT:
            saved_cfg = config_lib.replace(saved_cfg, key, old)
    if saved_cfg.inner.optimizer.startswith(user_optimizers.GIVEN):  # shapes the inner state only
        saved_cfg = config_lib.replace(saved_cfg, "inner.optimizer",
                                       config_lib.Config().inner.optimizer)  # fmt: skip
    saved_algorithm = recipe.algorithm_from_config(saved_cfg, s.layout.replica_axis_names,
                                                   outer_lr_as_input=True)  # fmt: skip
    like = jax.eval_shape(lambda p: init_replicas(saved_algorithm, p, s.layout.replicas),
                          s.state.anchor)  # fmt: skip
    like = s.state._replace(outer_state=parallel.place(
        like, saved_algorithm.kinds, s.mesh, abstract=True, fsdp_split=s.layout.fsdp
    ).outer_state)  # fmt: skip
    old = checkpoint.restore(mngr, like, step)

    def init(anchor):  # only the outer state is kept: XLA drops the replicas' part
        return init_replicas(s.algorithm, anchor, s.layout.replicas).outer_state

    shardings = jax.tree.map(lambda x: x.sharding, s.state.outer_state)
    state = old._replace(outer_state=jax.jit(init, out_shardings=shardings)(old.anchor))
    listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items() if k in outer)
    log.warning("resuming %s with another outer optimizer (%s): its state starts afresh at step "
                "%d (momentum lost)", path, listed, step)  # fmt: skip
    return Start(state, step, path, changes, meta.get("controls", {}), meta.get("data"))


def elastic(mngr, s, saved_replicas: int, step: int):
    """Resumes the checkpoint at ``step``, of ``saved_replicas`` replicas, with this run's count:
    the shared fields (step, anchor, outer state, a pending mean: as the algorithm's kinds
    declare) are kept; every replica restarts from the anchor with a fresh inner state (so an
    inner learning-rate schedule starts again)."""
    algorithm, kinds = s.algorithm, s.algorithm.kinds
    if kinds.anchor == PER_REPLICA:
        raise checkpoint.CheckpointError(
            f"the checkpoint has {saved_replicas} replicas, this run {s.layout.replicas}: an "
            "elastic restart needs one anchor, and with outer.mode=eager every replica has its own"
        )
    anchor = s.state.anchor
    like = jax.eval_shape(lambda: init_replicas(algorithm, anchor, saved_replicas))
    old = checkpoint.restore(mngr, like, step)
    fresh = init_replicas(algorithm, old.anchor, s.layout.replicas)
    state = state_lib.replace_shared(fresh, kinds, old)
    log.warning(
        "elastic restart at step %d: the checkpoint has %d replicas, this run %d; every replica "
        "restarts from the saved anchor with a fresh inner state (outer state kept)",
        int(old.step), saved_replicas, s.layout.replicas,
    )  # fmt: skip
    return parallel.place(state, kinds, s.mesh, fsdp_split=s.layout.fsdp)
