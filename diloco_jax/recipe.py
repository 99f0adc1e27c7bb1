"""The training application's edge: a :class:`~diloco_jax.config.Config` turned into the
library's objects (the library itself never reads a config)."""

from __future__ import annotations

import dataclasses

from diloco_jax.algorithm import Streaming, optim
from diloco_jax.algorithm.compress import Codec
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.config import Config


def codec_of(cfg: Config) -> Codec | None:
    """The codec ``cfg`` asks for (None for ``dct``, which is not a codec but an exchange)."""
    c = cfg.compress
    if c.codec == "dct":
        return None
    return Codec(c.codec, c.block, c.topk_fraction, c.min_size, c.error_feedback)


def dct_of(cfg: Config) -> DctConfig | None:
    c = cfg.compress
    return DctConfig(c.dct_chunk, c.dct_topk, c.dct_beta, c.min_size) if c.codec == "dct" else None


def algorithm_from_config(cfg: Config, axis_name, diagnostics: bool = False):
    """The algorithm that ``cfg`` asks for, reducing over ``axis_name``."""
    inner = optim.inner_adamw(total_steps=cfg.train.total_steps, **dataclasses.asdict(cfg.inner))
    outer = optim.outer_nesterov(
        learning_rate=cfg.outer.learning_rate,
        momentum=cfg.outer.momentum,
        nesterov=cfg.outer.nesterov,
    )
    return optim.make_algorithm(
        cfg.algorithm,
        inner,
        outer,
        sync_every=cfg.outer.sync_every,
        axis_name=axis_name,
        reset_inner_state=cfg.outer.reset_inner_state,
        diagnostics=diagnostics,
        codec=codec_of(cfg),
        dct_config=dct_of(cfg),
        streaming=Streaming(**dataclasses.asdict(cfg.streaming)),
        outer_mode=cfg.outer.mode,
    )
