"""The training application's edge: a :class:`~diloco_jax.config.Config` turned into the
library's objects (the library itself never reads a config), and the library's argument checks
applied to a config, with the library's argument names written as config keys."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from diloco_jax.algorithm import MomentSync, Streaming, check_options, optim
from diloco_jax.algorithm.compress import Codec
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.algorithm.gossip import Gossip
from diloco_jax.algorithm.robust import Attack, Merge, hostile_replicas
from diloco_jax.config import user_optimizers

if TYPE_CHECKING:  # config imports this module to check its values
    from diloco_jax.config.schema import Config

KEY_OF_OPTION = {
    **{f"inner.{k}": f"inner.{k}" for k in ("learning_rate", "warmup_steps", "final_lr_fraction",
                                            "weight_decay", "b1", "b2", "clip_norm", "optimizer",
                                            "momentum")},
    "inner.total_steps": "train.total_steps", "outer.learning_rate": "outer.learning_rate",
    **{f"outer.{k}": f"outer.{k}" for k in ("momentum", "optimizer", "b1", "b2", "eps",
                                            "weight_decay", "schedule", "warmup",
                                            "final_lr_fraction")},
    "sync_every": "outer.sync_every", "outer_mode": "outer.mode",
    "reset_inner_state": "outer.reset_inner_state", "streaming.fragments": "streaming.fragments",
    "streaming.overlap": "streaming.overlap", "streaming.mix": "streaming.mix",
    "codec.name": "compress.codec", "codec.block": "compress.block",
    "codec.topk_fraction": "compress.topk_fraction", "codec.min_size": "compress.min_size",
    "dct_config": "compress.codec", "dct.chunk": "compress.dct_chunk",
    "dct.topk": "compress.dct_topk", "dct.beta": "compress.dct_beta",
    "dct.min_size": "compress.min_size", "dct.bits": "compress.sparse_bits",
    "moment_sync": "desloc.first_moment_every", "gossip": "noloco.enabled",
    "gossip.replicas": "parallel.replicas", "gossip.pull": "noloco.pull",
    "gossip.pairings": "noloco.pairings", "late_merge": "sim.quorum",
    "moment_sync.first_every": "desloc.first_moment_every",
    "moment_sync.second_every": "desloc.second_moment_every",
    **{f"merge.{k}": f"merge.{k}" for k in ("rule", "trim", "clip", "radius", "iterations")},
    "attack.kind": "sim.attack", "attack.strength": "sim.attack_strength",
    "attack.hostile": "sim.attackers",
}  # fmt: skip


def option_keys(cfg: Config) -> dict[str, str]:
    """:data:`KEY_OF_OPTION` for ``cfg``: SparseLoCo's accumulator options are its own keys."""
    if cfg.compress.codec != "sparseloco":
        return KEY_OF_OPTION
    own = {f"dct.{k}": f"compress.sparse_{k}" for k in ("chunk", "topk", "beta", "bits")}
    return {**KEY_OF_OPTION, **own}


def codec_of(cfg: Config) -> Codec | None:
    """The codec ``cfg`` asks for (None for ``dct`` and ``sparseloco``, which are not codecs
    but exchanges)."""
    c = cfg.compress
    if c.codec in ACCUMULATORS:
        return None
    return Codec(c.codec, c.block, c.topk_fraction, c.min_size, c.error_feedback)


ACCUMULATORS = ("dct", "sparseloco")  # codec key values that choose dct_momentum's exchange


def dct_of(cfg: Config) -> DctConfig | None:
    """DCT momentum's or SparseLoCo's accumulator, as ``compress.codec`` chooses."""
    c = cfg.compress
    if c.codec == "dct":
        return DctConfig(c.dct_chunk, c.dct_topk, c.dct_beta, c.min_size)
    if c.codec == "sparseloco":
        return DctConfig(c.sparse_chunk, c.sparse_topk, c.sparse_beta, c.min_size, dct=False,
                         bits=c.sparse_bits)  # fmt: skip
    return None


def push_codec_of(cfg: Config) -> Codec | DctConfig | None:
    """How a learner's push travels (:mod:`diloco_jax.learners.payload`): the codec, or with
    ``dct`` and ``sparseloco`` the accumulator whose messages it carries."""
    return dct_of(cfg) or codec_of(cfg)


def _variants(cfg: Config) -> dict:
    """:func:`~diloco_jax.algorithm.diloco`'s variant arguments, as ``cfg`` sets them."""
    return dict(
        sync_every=cfg.outer.sync_every,
        streaming=Streaming(**dataclasses.asdict(cfg.streaming)),
        outer_mode=cfg.outer.mode,
        codec=codec_of(cfg),
        dct_config=dct_of(cfg),
        reset_inner_state=cfg.outer.reset_inner_state,
        moment_sync=MomentSync(cfg.desloc.first_moment_every, cfg.desloc.second_moment_every),
        gossip_config=gossip_of(cfg),
        late_merge=cfg.sim.quorum > 0,
        merge=Merge(**dataclasses.asdict(cfg.merge)),
        attack=attack_of(cfg),
    )


def attack_of(cfg: Config) -> Attack:
    """The hostile replicas ``cfg.sim`` asks for: ``sim.attackers`` of the replicas, chosen
    from the seed (none without an attack or attackers, or out of range: validation says)."""
    sim, replicas = cfg.sim, cfg.parallel.replicas
    if sim.attack == "none" or not 0 < sim.attackers < replicas:
        return Attack(sim.attack, (), sim.attack_strength, cfg.seed)
    return Attack(sim.attack, hostile_replicas(replicas, sim.attackers, cfg.seed),
                  sim.attack_strength, cfg.seed)  # fmt: skip


def sync_payloads(cfg: Config, params, replicas: int) -> tuple[list[int], str]:
    """``(P of each sync's reduce, one per streaming fragment; the topology it runs on)`` for
    ``cfg``: DiLoCo's pseudo-gradient as its codec or accumulator encodes it, on
    ``sim.topology``; NoLoCo's pseudo-gradient and anchor to one partner (``pairwise``); the
    baselines' float32 gradient (``params``: shapes and dtypes suffice)."""
    from diloco_jax.algorithm import gossip
    from diloco_jax.simulated import comms

    diloco = cfg.algorithm == "diloco"
    if diloco and cfg.noloco.enabled:
        return [gossip.pair_payload(params)], comms.PAIRWISE
    codec, dct_config = (codec_of(cfg), dct_of(cfg)) if diloco else (None, None)
    fragments = cfg.streaming.fragments if diloco else 1
    if cfg.sim.topology == "parameter_server" and dct_config is None:
        return comms.sync_payloads(params, codec, 1, num_fragments=fragments,
                                   payload=comms.push_payload), cfg.sim.topology  # fmt: skip
    payloads = comms.sync_payloads(params, codec, replicas, dct_config=dct_config,
                                   num_fragments=fragments)  # fmt: skip
    return payloads, cfg.sim.topology


def gossip_of(cfg: Config) -> Gossip | None:
    """NoLoCo's pairing, as ``cfg.noloco`` asks (None: the all-replica mean)."""
    n = cfg.noloco
    return Gossip(cfg.parallel.replicas, cfg.seed, n.pull, n.pairings) if n.enabled else None


def inner_of(cfg: Config, given: user_optimizers.Given = user_optimizers.NONE):
    """The inner optimizer ``cfg`` asks for: ``given.inner``, an import path's, or a built-in."""
    if given.inner is not None:
        return given.inner
    if cfg.inner.optimizer.startswith(user_optimizers.GIVEN):
        user_optimizers.recorded(cfg, given, {})  # the one-line error: given from Python
    if user_optimizers.is_import_path(cfg.inner.optimizer):
        return user_optimizers.imported(cfg.inner.optimizer, cfg.inner.args, "inner.optimizer")
    inner_args = dataclasses.asdict(cfg.inner)
    del inner_args["args"]
    return optim.inner_optimizer(inner_args.pop("optimizer"), total_steps=cfg.train.total_steps,
                                 **inner_args)  # fmt: skip


def outer_lr_input(cfg: Config) -> float:
    """The outer learning rate that the compiled step takes as an input rather than holding as
    a constant, so that runs differing only in it (a sweep of ``outer.learning_rate``) share
    one compiled step: ``outer.learning_rate`` for DiLoCo with a constant outer rate
    (``outer.schedule = constant``, no ``outer.warmup``), else 1.0 (the rate, or its schedule,
    is in the outer optimizer).

    :func:`algorithm_from_config` (``outer_lr_as_input=True``) then builds the outer optimizer
    with learning rate 1, and :func:`diloco_jax.run.setup.chunk_control` puts this rate in
    ``StepControl.outer_scale``, which multiplies the outer update. Every outer optimizer's
    update is its direction times ``-learning_rate``, so the product is the same float32 number
    either way: ``(-u) * lr`` and ``u * (-lr)`` round alike."""
    return float(cfg.outer.learning_rate) if outer_lr_is_input(cfg) else 1.0


def outer_lr_is_input(cfg: Config) -> bool:
    """Whether ``outer.learning_rate`` is an input of the compiled step rather than a constant
    in it (see :func:`outer_lr_input`)."""
    o = cfg.outer
    builtin = not user_optimizers.is_custom(o.optimizer)  # a user's transform holds its own
    return cfg.algorithm == "diloco" and builtin and o.schedule == "constant" and not o.warmup


def _optimizers(cfg: Config, outer_lr_as_input: bool = False,
                given: user_optimizers.Given | None = None):  # fmt: skip
    """The inner and outer optimizers ``cfg`` asks for (building them checks their arguments);
    with ``outer_lr_as_input``, the outer one's learning rate divided by
    :func:`outer_lr_input`. ``given``: the user's transforms from Python; None: only check
    (a user's optimizers, given or imported, are checked on the parameters:
    :func:`diloco_jax.config.user_optimizers.recorded`)."""
    if given is None:
        if not user_optimizers.is_custom(cfg.inner.optimizer):
            inner_of(cfg)
        if not user_optimizers.is_custom(cfg.outer.optimizer):
            _outer_of(cfg, outer_lr_as_input)
        return None, None
    return inner_of(cfg, given), _outer_of(cfg, outer_lr_as_input, given)


def _outer_of(cfg: Config, outer_lr_as_input: bool,
              given: user_optimizers.Given = user_optimizers.NONE):  # fmt: skip
    """The outer optimizer ``cfg`` asks for (see :func:`_optimizers`)."""
    if given.outer is not None:
        return given.outer
    if user_optimizers.is_import_path(cfg.outer.optimizer):
        return user_optimizers.imported(cfg.outer.optimizer, cfg.outer.args, "outer.optimizer")
    o = cfg.outer
    lr = o.learning_rate
    if outer_lr_as_input:
        optim.outer_optimizer(o.optimizer, learning_rate=lr)  # the rate checked, then divided
        lr /= outer_lr_input(cfg)
    outer = optim.outer_optimizer(
        o.optimizer, learning_rate=lr, momentum=outer_momentum(cfg), nesterov=o.nesterov,
        b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, schedule=o.schedule,
        warmup=o.warmup, total=max(cfg.train.total_steps // max(o.sync_every, 1), 1),
        final_lr_fraction=o.final_lr_fraction,
    )  # fmt: skip
    return outer


# sgd's outer momentum where the outer step is stale by a round (outer.overlap_momentum < 0):
# the momentum of a synchronous step (the paper's 0.9) makes a delayed step unstable wherever the
# inner steps converge within a round, and costs an eager one (docs/guides/learners.md, "Choosing
# a mode for your link"; scripts/overlap_study.sh)
OVERLAP_MOMENTUM = {"eager": 0.5, "delayed": 0.0}


def outer_momentum(cfg: Config) -> float:
    """sgd's outer momentum: ``outer.overlap_momentum`` where ``outer.mode`` is delayed or
    eager (< 0: :data:`OVERLAP_MOMENTUM`'s for the mode), else ``outer.momentum``."""
    o = cfg.outer
    if o.mode not in OVERLAP_MOMENTUM:
        return o.momentum
    return o.overlap_momentum if o.overlap_momentum >= 0 else OVERLAP_MOMENTUM[o.mode]


def check(cfg: Config) -> None:
    """Applies the library's own checks of the optimizers' and DiLoCo's arguments to ``cfg``;
    raises :class:`~diloco_jax.algorithm.OptionError` (:data:`KEY_OF_OPTION` names the keys)."""
    _optimizers(cfg)
    check_options(**_variants(cfg))


def algorithm_from_config(cfg: Config, axis_name, diagnostics: bool = False, *,
                          outer_lr_as_input: bool = False,
                          given: user_optimizers.Given = user_optimizers.NONE):  # fmt: skip
    """The algorithm that ``cfg`` asks for, reducing over ``axis_name``. With
    ``outer_lr_as_input`` its outer step must be scaled by :func:`outer_lr_input` (the
    training loop's controls do it: :func:`diloco_jax.run.setup.chunk_control`). ``given``:
    the user's own inner and outer transforms, from Python."""
    inner, outer = _optimizers(cfg, outer_lr_as_input, given)
    return optim.make_algorithm(
        cfg.algorithm, inner, outer, axis_name=axis_name, diagnostics=diagnostics, **_variants(cfg)
    )
