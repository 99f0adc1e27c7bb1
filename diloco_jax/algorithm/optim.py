"""The optimizers, built in one place from named arguments.

``inner_adamw`` is DiLoCo's inner optimizer (and the baselines' only one), ``outer_nesterov`` its
outer optimizer; ``make_algorithm`` assembles an algorithm: ``diloco``, ``ddp`` (synchronous
data parallelism) or ``single`` (one replica, inner optimizer only).
"""

from __future__ import annotations

import math

import optax

from diloco_jax.algorithm import Streaming, data_parallel, diloco, single
from diloco_jax.algorithm.compress import Codec
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.algorithm.exchange import AxisName
from diloco_jax.algorithm.options import require

ALGORITHMS = ("diloco", "ddp", "single")


def _finite(ok: bool, option: str, value: float, allowed: str) -> None:
    require(math.isfinite(value) and ok, option, value, allowed)


def inner_adamw(
    *,
    learning_rate: float,
    total_steps: int,
    warmup_steps: int,
    final_lr_fraction: float = 0.1,
    weight_decay: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    clip_norm: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay to ``final_lr_fraction * learning_rate``, after
    clipping gradients to global norm ``clip_norm`` (``clip_norm <= 0`` disables clipping).
    Raises :class:`~diloco_jax.algorithm.options.OptionError` (``inner.<argument>``) for a value
    out of range."""
    _finite(learning_rate > 0, "inner.learning_rate", learning_rate, "must be a finite number > 0")
    require(total_steps >= 1, "inner.total_steps", total_steps, "must be an integer >= 1")
    require(warmup_steps >= 0, "inner.warmup_steps", warmup_steps, "must be an integer >= 0")
    _finite(0 <= final_lr_fraction <= 1, "inner.final_lr_fraction", final_lr_fraction,
            "must be in [0, 1]")  # fmt: skip
    _finite(weight_decay >= 0, "inner.weight_decay", weight_decay, "must be a finite number >= 0")
    _finite(0 <= b1 < 1, "inner.b1", b1, "must be in [0, 1)")
    _finite(0 <= b2 < 1, "inner.b2", b2, "must be in [0, 1)")
    _finite(True, "inner.clip_norm", clip_norm, "must be a finite number (<= 0: no clipping)")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=learning_rate * final_lr_fraction,
    )
    adamw = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay)
    if clip_norm <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


def outer_nesterov(
    *, learning_rate: float = 0.7, momentum: float = 0.9, nesterov: bool = True
) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer: SGD with (Nesterov) momentum; plain SGD when ``momentum == 0``.
    Raises :class:`~diloco_jax.algorithm.options.OptionError` (``outer.<argument>``) for a value
    out of range."""
    _finite(learning_rate > 0, "outer.learning_rate", learning_rate, "must be a finite number > 0")
    _finite(0 <= momentum < 1, "outer.momentum", momentum, "must be in [0, 1)")
    return optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov and momentum > 0)


def make_algorithm(
    algorithm: str,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    *,
    sync_every: int,
    axis_name: AxisName,
    reset_inner_state: bool = False,
    diagnostics: bool = False,
    codec: Codec | None = None,
    dct_config: DctConfig | None = None,
    streaming: Streaming | None = None,
    outer_mode: str = "sync",
):
    """The algorithm named ``algorithm`` (one of :data:`ALGORITHMS`). Every one has
    ``kinds``, ``init``, ``update(state, grads, **control)`` and ``outer_params``; ``codec``,
    ``dct_config``, ``streaming`` and ``outer_mode`` are DiLoCo's variants."""
    if algorithm == "diloco":
        return diloco(
            inner, outer, sync_every=sync_every, axis_name=axis_name,
            reset_inner_state=reset_inner_state, diagnostics=diagnostics, codec=codec,
            dct_config=dct_config, streaming=streaming, outer_mode=outer_mode,
        )  # fmt: skip
    if algorithm == "ddp":
        return data_parallel(inner, axis_name=axis_name)
    if algorithm == "single":
        return single(inner)
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
