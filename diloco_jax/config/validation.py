"""The rules of a :class:`~diloco_jax.config.Config`: every value checked before anything is
loaded or compiled; the first bad key raises :class:`ConfigError` naming the key, its value and
what is allowed. The library's own option rules (``algorithm/options.py``) are reported here with
config keys.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

from diloco_jax.algorithm.compress import CODECS
from diloco_jax.algorithm.optim import ALGORITHMS
from diloco_jax.base import access, extras
from diloco_jax.base.errors import ConfigError
from diloco_jax.config.dotted import keys
from diloco_jax.config.schema import RUNTIMES, WANDB_MODES, Config
from diloco_jax.tasks.model import COMPUTE_DTYPES

_POSITIVE = (
    "model.d_model", "model.num_layers", "model.num_heads", "model.mlp_ratio", "data.seq_len",
    "data.batch_size", "parallel.replicas", "train.total_steps", "train.log_every",
    "train.eval_every", "train.keep_checkpoints", "resnet.width", "resnet.stages", "resnet.depth",
)  # fmt: skip
_NON_NEGATIVE = (
    "parallel.replica_devices", "parallel.data_devices", "parallel.cpu_devices",
    "parallel.device_memory_gib", "data.max_memory_mib", "inner.warmup_steps", "train.sample_chars",
    "train.checkpoint_every", "train.checkpoint_minutes", "data.image_size", "sim.chunk",
)  # fmt: skip


def _enforce(rules: Sequence[tuple[str, object, str]], flat: dict[str, Any]) -> None:
    """Raises for the first ``(key, ok, allowed)`` rule that fails, naming key, value and rule."""
    for key, ok, allowed in rules:
        if not ok:
            raise ConfigError(f"config key {key} = {flat[key]!r} is invalid: {allowed}")


_FACTORY = r"[A-Za-z_][\w.]*:[A-Za-z_]\w*"


def _json_object(text: str) -> bool:
    try:
        return not text or isinstance(json.loads(text), dict)
    except ValueError:
        return False


def notices(cfg: Config) -> list[str]:
    """One line each about values that are allowed but seldom what was meant (the run says
    them as it starts): a DiLoCo run that never syncs."""
    t, o = cfg.train, cfg.outer
    found = []
    if cfg.algorithm == "diloco" and o.sync_every > t.total_steps:
        found.append(f"outer.sync_every = {o.sync_every} > train.total_steps = {t.total_steps}: "
                     "this run never syncs (each replica trains alone); lower outer.sync_every "
                     "or raise train.total_steps")  # fmt: skip
    return found


def validate(cfg: Config) -> None:
    """Checks every value that does not depend on the devices (see the module's docstring)."""
    flat = keys(cfg)
    rules = [(key, flat[key] >= 1, "must be an integer >= 1") for key in _POSITIVE]
    rules += [(key, flat[key] >= 0, "must be >= 0") for key in _NON_NEGATIVE]
    _enforce(rules, flat)
    _validate_library_options(cfg)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    rules = [
        ("algorithm", cfg.algorithm in ALGORITHMS, f"must be one of {ALGORITHMS}"),
        ("seed", 0 <= cfg.seed < 2**31, "must be an integer in [0, 2**31)"),
        ("parallel.runtime", p.runtime in RUNTIMES, f"must be one of {RUNTIMES}"),
        ("model.d_model", m.d_model % m.num_heads == 0,
         f"must be divisible by model.num_heads = {m.num_heads}"),
        ("model.dropout", 0 <= m.dropout < 1, "must be in [0, 1)"),
        ("model.compute_dtype", m.compute_dtype in COMPUTE_DTYPES,
         f"must be one of {tuple(COMPUTE_DTYPES)}"),
        ("data.val_fraction", 0 < cfg.data.val_fraction < 1, "must be in (0, 1)"),
        ("data.train_split",
         cfg.data.corpus.startswith("tfds:") or (cfg.data.train_split, cfg.data.eval_split)
         == ("train", ""), "only TFDS datasets (data.corpus=tfds:NAME) have named splits "
         "(data.train_split, data.eval_split)"),
        ("parallel.replica_devices", p.replicas % max(p.replica_devices, 1) == 0,
         f"must divide parallel.replicas = {p.replicas}"),
        ("data.batch_size", cfg.data.batch_size % max(p.data_devices, 1) == 0,
         f"must be divisible by parallel.data_devices = {p.data_devices}"),
        ("train.checkpoint_every", t.checkpoint_every % t.log_every == 0,
         f"must be a multiple of train.log_every = {t.log_every} (saves happen between calls)"),
        ("train.checkpoint_every",
         cfg.algorithm != "diloco" or t.checkpoint_every % cfg.outer.sync_every == 0,
         f"must be a multiple of outer.sync_every = {cfg.outer.sync_every} (saves happen at "
         "sync boundaries)"),
        ("task.factory", not cfg.task.factory or re.fullmatch(_FACTORY, cfg.task.factory),
         "must be package.module:function"),
        ("task.args", _json_object(cfg.task.args), "must be a JSON object of keyword arguments"),
        ("train.eval_at_start", cfg.train.eval_at_start in ("auto", "true", "false"),
         "must be auto, true or false"),
        *[(f"{part}.args", _json_object(getattr(cfg, part).args),
           "must be a JSON object of keyword arguments") for part in ("inner", "outer")],
        *[(f"{part}.optimizer", ":" not in getattr(cfg, part).optimizer
           or getattr(cfg, part).optimizer.startswith("given:")
           or re.fullmatch(_FACTORY, getattr(cfg, part).optimizer),
           "must be a built-in name or package.module:function") for part in ("inner", "outer")],
        ("log.wandb_mode", cfg.log.wandb_mode in WANDB_MODES, f"must be one of {WANDB_MODES}"),
        ("log.wandb_project", bool(cfg.log.wandb_project.strip()), "must name a project"),
        ("log.wandb", not cfg.log.wandb or importlib.util.find_spec("wandb") is not None,
         f"needs the wandb package: {extras.install_hint('wandb')}"),
    ]  # fmt: skip
    _enforce(rules, flat)
    _validate_variants(cfg)
    _validate_sim(cfg)
    _validate_serve(cfg)
    _validate_syncer(cfg)


def removed_learners(sy) -> tuple[int, ...]:
    """``syncer.drop``'s learner indices (comma-separated; empty: none), as integers; an item
    that is not one is left for :func:`validate` to name."""
    return tuple(sorted({int(x) for x in _drop_items(sy) if x.isdigit()}))


def _drop_items(sy) -> list[str]:
    return [x.strip() for x in sy.drop.split(",") if x.strip()]


def _validate_syncer(cfg: Config) -> None:
    """The syncer's keys; a learner (``syncer.address`` set) runs DiLoCo (or Streaming DiLoCo
    with no overlap), its push through a codec or, with DCT momentum and SparseLoCo, the
    replicas' messages (the core refuses those with streaming)."""
    sy, t, o, st = cfg.syncer, cfg.train, cfg.outer, cfg.streaming
    where = [a.strip() for a in sy.address.split(",")] if sy.address else []
    hosts = [a.rpartition(":") for a in where]
    rules = [
        ("syncer.shards", sy.shards >= 1, "must be an integer >= 1"),
        ("syncer.shard", 0 <= sy.shard < sy.shards, f"must be in [0, syncer.shards = {sy.shards})"),
        ("syncer.address", not where or len(where) == sy.shards,
         f"holds {len(where)} address(es), but syncer.shards = {sy.shards}: one HOST:PORT per "
         "shard, comma-separated, shard 0's first"),
        *[("syncer.address", h and p.isdigit() and 0 < int(p) < 65536,
           f"must be HOST:PORT{'[,HOST:PORT...]' * (sy.shards > 1)}, not {a!r}")
          for a, (h, _, p) in zip(where, hosts, strict=True)],
        ("syncer.shards", sy.shards == 1 or st.fragments == 1 or cfg.compress.codec == "none",
         f"must be 1 with streaming.fragments = {st.fragments} and compress.codec = "
         f"{cfg.compress.codec} (syncer shards do not cut a codec's fragments yet)"),
        ("syncer.shards", sy.shards == 1 or o.mode != "eager",
         "must be 1 with outer.mode=eager (sharded syncers answer with the anchor)"),
        ("syncer.shards", sy.shards == 1 or cfg.compress.codec in (
            "none", "bf16", "int8", "fp8", "int4"), f"must be 1 with compress.codec = "
         f"{cfg.compress.codec}: it chooses what it sends over the whole vector, which "
         "syncer shards cannot cut"),
        ("syncer.shards", sy.shards == 1 or (not cfg.merge.clip
                                              and cfg.merge.rule != "centered_clip"),
         f"must be 1 with merge.clip = {cfg.merge.clip} and merge.rule = {cfg.merge.rule!r}: a "
         "push's norm needs every shard's part (coordinate-wise rules, trimmed_mean and "
         "median, go through shards)"),

        ("syncer.learners", sy.learners >= 1, "must be an integer >= 1"),
        *[("syncer.drop", x.isdigit() and int(x) < sy.learners,
           f"holds {x!r}: each item must be a learner index in [0, syncer.learners = "
           f"{sy.learners})") for x in _drop_items(sy)],
        ("syncer.status_port", 0 <= sy.status_port <= 65535, "must be in [0, 65535] (0: off)"),
        ("syncer.learner", 0 <= sy.learner < sy.learners,
         f"must be in [0, syncer.learners = {sy.learners})"),
        *[(f"syncer.{k}", getattr(sy, k) > 0 and math.isfinite(getattr(sy, k)),
           "must be a finite number of seconds > 0") for k in ("timeout", "dead_after",
                                                                "heartbeat")],
        ("syncer.heartbeat", sy.heartbeat < sy.dead_after,
         f"must be shorter than syncer.dead_after = {sy.dead_after} (a live learner would be "
         "dropped)"),
        ("syncer.quorum", 0 <= sy.quorum <= sy.learners,
         f"must be in [0, syncer.learners = {sy.learners}] (0: every learner, synchronous)"),
        ("syncer.grace", sy.grace > 0 and sy.grace <= sy.timeout,
         f"must be > 0 seconds and at most syncer.timeout = {sy.timeout} (the deadline closes "
         "a round first)"),
        ("syncer.quorum", sy.quorum == 0 or st.fragments == 1,
         f"must be 0 with streaming.fragments = {st.fragments} (a late push would hold another "
         "round's fragment)"),
        ("syncer.max_late", sy.max_late >= 1, "must be an integer >= 1 (rounds)"),
        ("syncer.late_weight", 0 <= sy.late_weight <= 1, "must be in [0, 1]"),
        ("syncer.rounds", sy.rounds >= 0, "must be an integer >= 0 (0: train.total_steps)"),
        ("syncer.examples", sy.examples >= 0, "must be an integer >= 0 (0: no budget)"),
        ("syncer.token_file", not sy.token_file or pathlib.Path(sy.token_file).is_file(),
         "must be a file holding the token"),
        ("syncer.credentials", not sy.credentials or (
            pathlib.Path(sy.credentials) / "ca.pem").is_file(),
         "must be a folder made by `diloco-syncer certs DIR` (DIR/syncer or DIR/learner_I), "
         "holding ca.pem"),
        ("syncer.address", not sy.address or sy.credentials or sy.insecure or all(
            access.is_loopback(h.strip("[]")) for h, _, _ in hosts),
         "is off loopback without TLS: set syncer.credentials (a folder of "
         "`diloco-syncer certs DIR`), or syncer.insecure=true to send credentials and tensors in "
         "clear"),
        ("syncer.mutual_tls", not sy.mutual_tls or sy.credentials,
         "needs TLS: set syncer.credentials"),
    ]  # fmt: skip
    if sy.address:
        plain = {"algorithm": cfg.algorithm == "diloco",
                 "noloco.enabled": not cfg.noloco.enabled,
                 "desloc.first_moment_every": not (cfg.desloc.first_moment_every
                                                   or cfg.desloc.second_moment_every),
                 "sim.quorum": not cfg.sim.quorum, "sim.chunk": not cfg.sim.chunk}  # fmt: skip
        rules += [(key, ok, "is not supported by a learner yet (syncer.address): it runs plain "
                   "DiLoCo, its replicas whole") for key, ok in plain.items()]  # fmt: skip
        rules.append(("streaming.overlap", st.overlap % t.log_every == 0,
                      f"must be a multiple of train.log_every = {t.log_every} for a learner "
                      "(syncer.address): an answer lands between calls"))  # fmt: skip
        period = o.sync_every // max(st.fragments, 1)  # a sync of one fragment each
        per = f"divided by streaming.fragments = {st.fragments} ({period}) " * (st.fragments > 1)
        rules.append(("outer.sync_every", period % t.log_every == 0,
                      f"{per}must be a multiple of train.log_every = {t.log_every} for a "
                      "learner (its syncs happen between calls)"))  # fmt: skip
    rules += _answers_rules(cfg)
    _enforce(rules, keys(cfg))


def _answers_rules(cfg: Config) -> list:
    """compress.answers: a syncer's answers, through a codec, of the anchor (not a mean, nor a
    streaming fragment)."""
    c, on = cfg.compress, cfg.compress.answers
    return [
        ("compress.answers", not on or cfg.syncer.address,
         "compresses a syncer's answers: it needs syncer.address (learners and a syncer)"),
        ("compress.answers", not on or c.codec in ("bf16", "int8", "fp8", "int4", "topk"),
         "needs compress.codec bf16, int8, fp8, int4 or topk (the answers go through it)"),
        ("compress.answers", not on or cfg.outer.mode != "eager",
         "does not combine with outer.mode=eager (the answers are the rounds' means)"),
        ("compress.answers", not on or cfg.streaming.fragments == 1,
         "does not combine with streaming.fragments > 1 yet"),
    ]  # fmt: skip


def _validate_serve(cfg: Config) -> None:
    sv = cfg.serve
    token_file = pathlib.Path(sv.token_file) if sv.token_file else None
    has_token = bool(os.environ.get(access.TOKEN_ENV)) or token_file is not None
    rules = [
        ("serve.port", 0 <= sv.port <= 65535, "must be in [0, 65535] (0: no server)"),
        ("serve.host", not sv.port or access.is_loopback(sv.host) or has_token,
         f"is not a loopback address: set serve.token_file or ${access.TOKEN_ENV} (every request "
         "then needs the token)"),
        ("serve.token_file", token_file is None or (token_file.is_file() and
                                                    token_file.read_text().strip() != ""),
         "must be a file holding the token"),
    ]  # fmt: skip
    _enforce(rules, keys(cfg))


def _validate_library_options(cfg: Config) -> None:
    """The library's own checks of DiLoCo's arguments (``check_options``: ranges and what
    combines), reported with config keys."""
    from diloco_jax.algorithm import OptionError
    from diloco_jax.config import recipe

    codecs = (*CODECS, "dct", "sparseloco")  # the codec key also chooses these accumulators
    _enforce([("compress.codec", cfg.compress.codec in codecs, f"must be one of {codecs}")],
             keys(cfg))  # fmt: skip
    try:
        recipe.check(cfg)
    except OptionError as e:
        names = recipe.option_keys(cfg)
        key = names[e.option]
        allowed = e.render(names)
        raise ConfigError(f"config key {key} = {keys(cfg)[key]!r} is invalid: {allowed}") from None


def _validate_variants(cfg: Config) -> None:
    """What the config adds to the library's checks: which variants need DiLoCo, fragments
    against the model's layers, one error-feedback key shared by codecs and DCT momentum."""
    c, st, o = cfg.compress, cfg.streaming, cfg.outer
    diloco, plain = cfg.algorithm == "diloco", st.fragments == 1 and st.overlap == 0
    sim = cfg.sim
    rules = [
        ("compress.codec", c.codec == "none" or diloco,
         f"compresses DiLoCo's pseudo-gradients; algorithm is {cfg.algorithm!r}"),
        ("outer.mode", o.mode == "sync" or diloco,
         f"overlaps DiLoCo's outer step; algorithm is {cfg.algorithm!r}"),
        ("outer.overlap_momentum", o.overlap_momentum < 1 and math.isfinite(o.overlap_momentum),
         "must be < 1 (< 0: the mode's own, 0.5 eager and 0 delayed)"),
        ("streaming.fragments", st.fragments == 1 or diloco,
         f"streams DiLoCo's syncs; algorithm is {cfg.algorithm!r}"),
        ("merge.rule", diloco or (cfg.merge.rule == "mean" and not cfg.merge.clip),
         f"merges DiLoCo's pseudo-gradients; algorithm is {cfg.algorithm!r}"),
        ("sim.attack", diloco or sim.attack == "none",
         f"replaces DiLoCo's pseudo-gradients; algorithm is {cfg.algorithm!r}"),
        ("sim.attackers", 0 <= sim.attackers < cfg.parallel.replicas,
         f"must be in [0, parallel.replicas = {cfg.parallel.replicas}): one replica at least "
         "stays honest"),
        ("noloco.enabled", diloco or not cfg.noloco.enabled,
         f"pairs DiLoCo's replicas; algorithm is {cfg.algorithm!r}"),
        ("desloc.first_moment_every",
         diloco or not (cfg.desloc.first_moment_every or cfg.desloc.second_moment_every),
         f"averages DiLoCo's replicas' moments; algorithm is {cfg.algorithm!r}"),
        ("streaming.fragments", st.fragments <= cfg.model.num_layers,
         f"must be <= model.num_layers = {cfg.model.num_layers} (fragments are strided layers)"),
        ("compress.error_feedback", c.codec not in ("dct", "sparseloco") or not c.error_feedback,
         f"{c.codec} keeps what it does not send in its accumulator already; set it to false"),
        ("streaming.fragments", plain or not (sim.speeds or sim.dylu or sim.drop or sim.drop_prob),
         "streaming does not combine with simulated stragglers or failures (sim.speeds, "
         "sim.dylu, sim.drop, sim.drop_prob)"),
    ]  # fmt: skip
    _enforce(rules, keys(cfg))


def _validate_sim(cfg: Config) -> None:
    from diloco_jax.simulated import comms, schedule

    sim = cfg.sim
    try:
        schedule.parse_speeds(sim.speeds, cfg.parallel.replicas)
        schedule.parse_drops(sim.drop, cfg.parallel.replicas)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    rules = [
        ("sim.drop_prob", 0 <= sim.drop_prob < 1, "must be in [0, 1)"),
        ("sim.network", sim.network in comms.NETWORKS, f"must be one of {tuple(comms.NETWORKS)}"),
        ("sim.topology", sim.topology in comms.TOPOLOGIES, f"must be one of {comms.TOPOLOGIES}"),
        ("sim.step_time_s", sim.step_time_s >= 0, "must be >= 0 (0: measured)"),
        ("sim.bandwidth_gbps", sim.bandwidth_gbps >= 0, "must be >= 0 (0: the network preset's)"),
        ("sim.quorum", 0 <= sim.quorum <= cfg.parallel.replicas,
         f"must be in [0, parallel.replicas = {cfg.parallel.replicas}] (0: wait for all)"),
        ("sim.quorum", not sim.quorum or cfg.algorithm == "diloco",
         f"lets DiLoCo's syncs go without late replicas; algorithm is {cfg.algorithm!r}"),
        ("sim.quorum", not sim.quorum or not (sim.dylu or sim.drop or sim.drop_prob),
         "does not combine with sim.dylu, sim.drop or sim.drop_prob (late replicas are its own "
         "straggler policy)"),
        ("sim.grace", sim.grace >= 0 and math.isfinite(sim.grace), "must be a finite number >= 0"),
        ("sim.offload", not sim.offload or sim.chunk,
         "needs sim.chunk > 0 (the replicas waiting for their chunk are what goes to the host)"),
    ]  # fmt: skip
    if sim.chunk:
        replicas = cfg.parallel.replicas
        rules += [
            ("sim.chunk", replicas % sim.chunk == 0, f"must divide parallel.replicas = {replicas}"),
            ("sim.chunk", cfg.algorithm == "diloco",
             f"chunks DiLoCo's replicas; algorithm is {cfg.algorithm!r}"),
            ("sim.chunk", cfg.parallel.runtime in ("auto", "sim"),
             f"runs in the simulator; parallel.runtime is {cfg.parallel.runtime!r}"),
            ("sim.chunk", cfg.streaming.overlap == 0,
             "does not combine with streaming.overlap > 0 (a fragment landing between syncs)"),
        ]  # fmt: skip
    _enforce(rules, keys(cfg))
