"""The optimizers, built in one place from named arguments.

``inner_adamw`` is DiLoCo's inner optimizer (and the baselines' only one), ``outer_nesterov`` its
outer optimizer; ``make_algorithm`` assembles an algorithm: ``diloco``, ``ddp`` (synchronous
data parallelism) or ``single`` (one replica, inner optimizer only).
"""

from __future__ import annotations

import math

import jax
import optax

from diloco_jax.algorithm import Streaming, data_parallel, diloco, single
from diloco_jax.algorithm.compress import Codec
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.algorithm.exchange import AxisName
from diloco_jax.algorithm.options import require

ALGORITHMS = ("diloco", "ddp", "single")


def _finite(ok: bool, option: str, value: float, allowed: str) -> None:
    require(math.isfinite(value) and ok, option, value, allowed)


INNER_OPTIMIZERS = ("adamw", "muon")


def inner_optimizer(
    name: str = "adamw",
    *,
    learning_rate: float,
    total_steps: int,
    warmup_steps: int,
    final_lr_fraction: float = 0.1,
    weight_decay: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    clip_norm: float = 1.0,
    momentum: float = 0.95,
) -> optax.GradientTransformation:
    """The inner optimizer, after clipping gradients to global norm ``clip_norm`` (``<= 0``: no
    clipping), its learning rate warmed up linearly from 0 then decayed by a cosine to
    ``final_lr_fraction * learning_rate`` at ``total_steps``:

    * ``adamw``: AdamW (``b1``, ``b2``, ``weight_decay``), the paper's;
    * ``muon``: MuLoCo's (Thérien et al., 2025, arXiv 2505.23725): optax's ``contrib.muon``
      (Nesterov momentum ``momentum``, orthogonalised by Newton-Schulz) on the weight matrices
      :func:`muon_dimensions` picks, AdamW on the rest (with Nesterov momentum, as optax's
      muon runs it). Muon's updates are scaled to AdamW's
      RMS (``consistent_rms=0.2``, Liu et al., 2025, arXiv 2502.16982), so both share the
      learning rate, its schedule and the weight decay.

    Raises :class:`~diloco_jax.algorithm.options.OptionError` (``inner.<argument>``) for a value
    out of range."""
    require(name in INNER_OPTIMIZERS, "inner.optimizer", name,
            f"must be one of {INNER_OPTIMIZERS}")  # fmt: skip
    _finite(learning_rate > 0, "inner.learning_rate", learning_rate, "must be a finite number > 0")
    require(total_steps >= 1, "inner.total_steps", total_steps, "must be an integer >= 1")
    require(warmup_steps >= 0, "inner.warmup_steps", warmup_steps, "must be an integer >= 0")
    _finite(0 <= final_lr_fraction <= 1, "inner.final_lr_fraction", final_lr_fraction,
            "must be in [0, 1]")  # fmt: skip
    _finite(weight_decay >= 0, "inner.weight_decay", weight_decay, "must be a finite number >= 0")
    _finite(0 <= b1 < 1, "inner.b1", b1, "must be in [0, 1)")
    _finite(0 <= b2 < 1, "inner.b2", b2, "must be in [0, 1)")
    _finite(True, "inner.clip_norm", clip_norm, "must be a finite number (<= 0: no clipping)")
    _finite(0 <= momentum < 1, "inner.momentum", momentum, "must be in [0, 1)")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=learning_rate * final_lr_fraction,
    )
    if name == "adamw":
        tx = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay)
    else:
        from optax.contrib import muon

        tx = muon(schedule, beta=momentum, weight_decay=weight_decay, adam_b1=b1, adam_b2=b2,
                  adam_weight_decay=weight_decay, muon_weight_dimension_numbers=muon_dimensions,
                  consistent_rms=0.2)  # fmt: skip
    return tx if clip_norm <= 0 else optax.chain(optax.clip_by_global_norm(clip_norm), tx)


def inner_adamw(**kwargs) -> optax.GradientTransformation:
    """DiLoCo's inner optimizer, the paper's: AdamW after clipping gradients by their global
    norm, its learning rate warmed up linearly from 0, then decayed by a cosine.

    Keyword Args:
      learning_rate (float): the peak learning rate, > 0 (required).
      total_steps (int): inner steps of the run, where the cosine ends (required).
      warmup_steps (int): steps of the linear warmup from 0 (required).
      final_lr_fraction (float): the learning rate at ``total_steps``, as a fraction of the
        peak (default 0.1).
      weight_decay (float): AdamW's decoupled weight decay (default 0.1).
      b1 (float): AdamW's first-moment decay (default 0.9).
      b2 (float): AdamW's second-moment decay (default 0.95).
      clip_norm (float): the global norm gradients are clipped to (default 1.0; ``<= 0``: no
        clipping).

    Returns:
      :func:`optax.adamw` with this schedule, after :func:`optax.clip_by_global_norm` (the two
      joined by :func:`optax.chain`) unless ``clip_norm <= 0``.

    Raises:
      OptionError: a value out of range, named as its config key (``inner.<argument>``).
    """
    return inner_optimizer("adamw", **kwargs)


def muon_dimensions(params):
    """Which leaves Muon orthogonalises, as optax's ``MuonDimensionNumbers`` (None: AdamW):
    every weight matrix named ``kernel`` (a dense ``[in, out]``, or a convolution's ``[..., in,
    out]`` with every axis but the last reduced), except the output ``head``; embeddings,
    biases and norms stay with AdamW, as in MuLoCo and Muon's own recipe."""
    from optax.contrib import MuonDimensionNumbers

    def spec(path, x):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if names[-1] != "kernel" or "head" in names or x.ndim < 2:
            return None
        return MuonDimensionNumbers(tuple(range(x.ndim - 1)), x.ndim - 1)

    return jax.tree_util.tree_map_with_path(spec, params)


def outer_nesterov(
    *, learning_rate: float = 0.7, momentum: float = 0.9, nesterov: bool = True
) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer: SGD with (Nesterov) momentum, fed the replicas' mean
    pseudo-gradient. The paper's is the default; ``momentum=0`` is plain SGD, and at
    ``learning_rate=1`` plain averaging (FedAvg).

    Args:
      learning_rate: the outer learning rate, > 0.
      momentum: the momentum, in ``[0, 1)`` (0: none).
      nesterov: Nesterov momentum (where ``momentum > 0``).

    Returns:
      :func:`optax.sgd` with these settings.

    Raises:
      OptionError: a value out of range, named as its config key (``outer.<argument>``).
    """
    _finite(learning_rate > 0, "outer.learning_rate", learning_rate, "must be a finite number > 0")
    _finite(0 <= momentum < 1, "outer.momentum", momentum, "must be in [0, 1)")
    return optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov and momentum > 0)


OUTER_OPTIMIZERS = ("sgd", "adam", "adamw")
OUTER_SCHEDULES = ("constant", "cosine", "linear")


def outer_schedule(
    learning_rate: float, *, schedule: str = "constant", warmup: int = 0, total: int = 1,
    final_lr_fraction: float = 0.0,
) -> optax.Schedule | float:  # fmt: skip
    """The outer learning rate per outer step (the outer optimizer counts its own steps, one
    per sync of its fragment): ``constant``, or a linear ramp from 0 over ``warmup`` outer steps
    then ``cosine`` or ``linear`` decay to ``final_lr_fraction * learning_rate`` at outer step
    ``total``. ``constant`` with no warmup is the plain float (no schedule)."""
    require(schedule in OUTER_SCHEDULES, "outer.schedule", schedule,
            f"must be one of {OUTER_SCHEDULES}")  # fmt: skip
    require(warmup >= 0, "outer.warmup", warmup, "must be an integer >= 0")
    _finite(0 <= final_lr_fraction <= 1, "outer.final_lr_fraction", final_lr_fraction,
            "must be in [0, 1]")  # fmt: skip
    if schedule == "constant" and not warmup:
        return learning_rate
    end = learning_rate if schedule == "constant" else learning_rate * final_lr_fraction
    decay_steps = max(total - warmup, 1)
    decay = (optax.cosine_decay_schedule(learning_rate, decay_steps, end / learning_rate)
             if schedule == "cosine"
             else optax.linear_schedule(learning_rate, end, decay_steps))  # fmt: skip
    ramp = optax.linear_schedule(0.0, learning_rate, warmup)
    return optax.join_schedules([ramp, decay], [warmup]) if warmup else decay


def outer_optimizer(
    name: str = "sgd",
    *,
    learning_rate: float = 0.7,
    momentum: float = 0.9,
    nesterov: bool = True,
    b1: float = 0.9,
    b2: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    schedule: str = "constant",
    warmup: int = 0,
    total: int = 1,
    final_lr_fraction: float = 0.0,
) -> optax.GradientTransformation:
    """The outer optimizer, fed the replicas' mean pseudo-gradient ``anchor - mean(params)`` as
    its gradient:

    * ``sgd``: :func:`outer_nesterov` (the paper: lr 0.7, Nesterov momentum 0.9; ``momentum=0``
      is plain SGD, and at lr 1 FedAvg; with one replica, Nesterov is SNOO, arXiv 2510.15830,
      and momentum 0 is Lookahead);
    * ``adam`` / ``adamw``: Adam on the pseudo-gradient (``b1``, ``b2``, ``eps``; ``adamw``
      decays the anchor by ``weight_decay``). Adam normalises the step, so its learning rate
      is a per-coordinate step size: about what the inner steps move a weight in one round.

    The learning rate follows :func:`outer_schedule` over ``total`` outer steps. Raises
    :class:`~diloco_jax.algorithm.options.OptionError` (``outer.<argument>``) for a value out of
    range."""
    require(name in OUTER_OPTIMIZERS, "outer.optimizer", name,
            f"must be one of {OUTER_OPTIMIZERS}")  # fmt: skip
    _finite(learning_rate > 0, "outer.learning_rate", learning_rate, "must be a finite number > 0")
    lr = outer_schedule(learning_rate, schedule=schedule, warmup=warmup, total=total,
                        final_lr_fraction=final_lr_fraction)  # fmt: skip
    _finite(0 <= momentum < 1, "outer.momentum", momentum, "must be in [0, 1)")
    _finite(0 <= b1 < 1, "outer.b1", b1, "must be in [0, 1)")
    _finite(0 <= b2 < 1, "outer.b2", b2, "must be in [0, 1)")
    _finite(eps > 0, "outer.eps", eps, "must be a finite number > 0")
    _finite(weight_decay >= 0, "outer.weight_decay", weight_decay, "must be a finite number >= 0")
    require(name == "adamw" or weight_decay == 0, "outer.weight_decay", weight_decay,
            "needs outer.optimizer = 'adamw'")  # fmt: skip
    if name == "sgd":
        return optax.sgd(lr, momentum=momentum or None, nesterov=nesterov and momentum > 0)
    if name == "adam":
        return optax.adam(lr, b1=b1, b2=b2, eps=eps)
    return optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)


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
    **variants,
):
    """The algorithm named ``algorithm``, DiLoCo or a baseline, with one interface: every one
    has ``kinds``, ``init``, ``update(state, grads, **control)`` and ``outer_params``, so one
    training loop runs them all.

    Args:
      algorithm: ``"diloco"`` (:func:`~diloco_jax.diloco`), ``"ddp"``
        (:func:`~diloco_jax.data_parallel`) or ``"single"`` (:func:`~diloco_jax.single`).
      inner: the per-replica optimizer (every algorithm's).
      outer: DiLoCo's outer optimizer (unused by the baselines).
      sync_every: DiLoCo's inner steps between syncs.
      axis_name: the named axis (or axes) spanning the replicas.
      reset_inner_state: as for :func:`~diloco_jax.diloco`.
      diagnostics: as for :func:`~diloco_jax.diloco`.
      codec: as for :func:`~diloco_jax.diloco`.
      dct_config: as for :func:`~diloco_jax.diloco`.
      streaming: as for :func:`~diloco_jax.diloco`.
      outer_mode: as for :func:`~diloco_jax.diloco`.
      **variants: DiLoCo's other variants, as for :func:`~diloco_jax.diloco`:
        ``moment_sync``, ``gossip_config``, ``late_merge``, ``merge``,
        ``attack``.

    Returns:
      A :class:`~diloco_jax.Diloco`, or the baselines' :class:`~diloco_jax.algorithm.Local`.

    Raises:
      ValueError: an unknown ``algorithm``; :class:`~diloco_jax.OptionError` (a ValueError)
        for DiLoCo's options, as :func:`~diloco_jax.diloco` raises it.
    """
    if algorithm == "diloco":
        return diloco(
            inner, outer, sync_every=sync_every, axis_name=axis_name,
            reset_inner_state=reset_inner_state, diagnostics=diagnostics, codec=codec,
            dct_config=dct_config, streaming=streaming, outer_mode=outer_mode,
            **variants,
        )  # fmt: skip
    if algorithm == "ddp":
        return data_parallel(inner, axis_name=axis_name)
    if algorithm == "single":
        return single(inner)
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
