"""Merging pseudo-gradients that a few replicas (or learners) may have made harmful: robust
rules in place of the weighted mean, one implementation for the simulator, the mesh runtime and
the syncer (issue 63).

A :class:`Merge` names the rule. Every function here takes the pseudo-gradients of the ``R``
contributors stacked on a leading axis (``x_R``: ``[R, ...]``), their weights ``w_R`` (examples;
0: left out) and which of them count (``valid_R``: a weight above 0 and finite values; the
others' values are never read, NaN included). Everything is computed in float32 in a fixed
order, so the same inputs give the same bits on every layout.

* ``mean``: ``sum_r w_r x_r / sum_r w_r`` (the paper's; the default, the plain exchange's
  ``pmean`` unchanged).
* ``trimmed_mean``: coordinate by coordinate, the ``trim`` smallest and ``trim`` largest of the
  counted values are dropped and the rest averaged with their weights. With ``n`` counted,
  at most ``(n - 1) // 2`` are dropped from each side (one value always remains).
* ``median``: coordinate by coordinate, the weighted median: the counted values sorted, the
  mean of the first whose cumulative weight reaches half the total and the first that passes
  it (equal weights: the usual median, the two middle values' mean for an even count).
* ``centered_clip``: Karimireddy, He & Jaggi (2021): from the center ``v`` (the last merge's
  result: a contributor far from where the anchor went last round is clipped), ``iterations``
  times ``v <- v + sum_r (w_r / W) min(1, tau / |x_r - v|) (x_r - v)``, with ``tau`` =
  ``radius`` x the median of the counted ``|x_r - v|`` (the radius is relative, so one value
  serves any model and learning rate). The norms are over the whole fragment.
* ``clip`` > 0, before any rule: each pseudo-gradient whose norm passes ``clip`` x the median
  norm of the round's counted ones is scaled down to it (adaptive clipping, after Allouah et
  al.'s ARC, 2024, whose radius is also taken from the round's own norms).

Weights: each rule weighs by examples as written above; a rule that drops or clips a value
leaves its weight on the others, so a contributor that declares many examples moves a
coordinate-wise rule no further than its place in the sorted order allows.

Attacks (:class:`Attack`, issue 63's study): ``f`` hostile replicas replace what they send
once every replica's pseudo-gradient is gathered, knowing the honest ones (the omniscient
attacker of the papers; ``mu`` and ``sigma``: the honest pseudo-gradients' mean and standard
deviation, coordinate by coordinate; ``s``: ``Attack.strength``, 0 for each attack's own):

* ``sign_flip``: ``-s x`` (s = 1); ``scale``: ``s x`` (s = 1000);
* ``gaussian``: ``x + N(0, (s |mu|_rms)^2)`` (s = 10), drawn from ``(Attack.seed, the sync)``;
* ``alie`` ("a little is enough", Baruch et al. 2019): ``mu - s sigma`` (s = 1);
* ``ipm`` (inner-product manipulation, Xie et al. 2020): ``-s mu`` (s = 0.1);
* ``inflate``: its own values with ``s`` x its weight (s = 10): a learner declaring examples
  it did not train.

Every replica computes the same replacement from the same gathered rows, so an attack is the
same on every layout.

Memory: the exchange gathers every replica's pseudo-gradient onto each (``R x`` the fragment
per replica; under ``vmap``, ``R x R x`` on one device), where the mean's ``pmean`` holds none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diloco_jax.algorithm import compress
from diloco_jax.algorithm.options import require

RULES = ("mean", "trimmed_mean", "median", "centered_clip")
ATTACKS = ("none", "sign_flip", "scale", "gaussian", "alie", "ipm", "inflate")
STRENGTH = {"sign_flip": 1.0, "scale": 1000.0, "gaussian": 10.0, "alie": 1.0, "ipm": 0.1,
            "inflate": 10.0}  # fmt: skip


class Merge(NamedTuple):
    """How a sync merges the pseudo-gradients (the ``merge`` of :func:`~diloco_jax.diloco`).
    ``Merge()`` is the weighted mean."""

    rule: str = "mean"  # one of RULES
    trim: int = 1  # trimmed_mean: values dropped from each side, coordinate by coordinate
    clip: float = 0.0  # > 0: each norm clipped to clip x the round's median norm, first
    radius: float = 1.0  # centered_clip: tau as a multiple of the median distance to the center
    iterations: int = 3  # centered_clip: clipping steps per sync

    @property
    def plain(self) -> bool:
        """The weighted mean without clipping: the plain exchange, bit for bit."""
        return self.rule == "mean" and self.clip == 0


class Attack(NamedTuple):
    """Hostile replicas, for studying the rules (the ``attack`` of :func:`~diloco_jax.diloco`).
    ``Attack()`` is none."""

    kind: str = "none"  # one of ATTACKS
    hostile: tuple[int, ...] = ()  # the hostile replicas' indices
    strength: float = 0.0  # 0: the attack's own (STRENGTH)
    seed: int = 0  # the gaussian attack's noise

    @property
    def active(self) -> bool:
        return self.kind != "none" and bool(self.hostile)

    @property
    def s(self) -> float:
        return self.strength or STRENGTH.get(self.kind, 0.0)


def hostile_replicas(replicas: int, count: int, seed: int) -> tuple[int, ...]:
    """``count`` of ``replicas`` chosen from ``seed`` (sorted): the same on every layout."""
    import numpy as np

    return tuple(sorted(int(i) for i in np.random.default_rng([seed, 63]).choice(
        replicas, count, replace=False)))  # fmt: skip


def validate_attack(attack: Attack, replicas: int | None = None) -> None:
    """Raises :class:`~diloco_jax.OptionError` naming the first bad field."""
    require(attack.kind in ATTACKS, "attack.kind", attack.kind, f"must be one of {ATTACKS}")
    require(math.isfinite(attack.strength) and attack.strength >= 0, "attack.strength",
            attack.strength, "must be finite and >= 0 (0: the attack's own)")  # fmt: skip
    require(len(set(attack.hostile)) == len(attack.hostile), "attack.hostile", attack.hostile,
            "must not repeat a replica")  # fmt: skip
    if replicas is not None:
        require(all(0 <= i < replicas for i in attack.hostile) and len(attack.hostile) < replicas,
                "attack.hostile", attack.hostile, "must be replicas in [0, R), at least one of "
                "them honest")  # fmt: skip


def attacked(
    attack: Attack, leaves_R: list, w_R: jax.Array, valid_R: jax.Array, count: jax.Array
) -> tuple[list, jax.Array]:
    """``(leaves_R, w_R)`` with the hostile rows replaced as ``attack`` says (``count``: the
    syncs so far, the gaussian noise's key). A hostile replica left out stays out."""
    if not attack.active:
        return leaves_R, w_R
    n = w_R.shape[0]
    hostile_R = jnp.zeros(n, bool).at[jnp.asarray(attack.hostile)].set(True)
    honest_R = valid_R & ~hostile_R
    s = attack.s
    if attack.kind == "inflate":
        return leaves_R, jnp.where(hostile_R, s * w_R, w_R)
    ones = jnp.ones(n, jnp.float32)
    out = []
    key = jax.random.fold_in(jax.random.key(attack.seed), count)
    rms = jnp.zeros([], jnp.float32)
    if attack.kind == "gaussian":
        means = [weighted_mean(x, ones, honest_R) for x in leaves_R]
        size = sum(m.size for m in means)
        rms = jnp.sqrt(sum(jnp.sum(jnp.square(m)) for m in means) / size)
    for j, x in enumerate(leaves_R):
        x = x.astype(jnp.float32)
        if attack.kind == "sign_flip":
            bad = -s * x
        elif attack.kind == "scale":
            bad = s * x
        elif attack.kind == "gaussian":
            noise = jax.random.normal(jax.random.fold_in(key, j), x.shape, jnp.float32)
            bad = x + s * rms * noise
        else:
            mu = weighted_mean(x, ones, honest_R)
            if attack.kind == "ipm":
                bad = jnp.broadcast_to(-s * mu, x.shape)
            else:  # alie
                var = weighted_mean(jnp.square(x - mu[None]), ones, honest_R)
                bad = jnp.broadcast_to(mu - s * jnp.sqrt(var), x.shape)
        out.append(jnp.where(_rows(hostile_R, x), bad, x))
    return out, w_R


def validate(merge: Merge) -> None:
    """Raises :class:`~diloco_jax.OptionError` naming the first bad field."""
    require(merge.rule in RULES, "merge.rule", merge.rule, f"must be one of {RULES}")
    require(isinstance(merge.trim, int) and merge.trim >= 0, "merge.trim", merge.trim,
            "must be an integer >= 0")  # fmt: skip
    require(math.isfinite(merge.clip) and merge.clip >= 0, "merge.clip", merge.clip,
            "must be finite and >= 0 (0: no clipping)")  # fmt: skip
    require(math.isfinite(merge.radius) and merge.radius > 0, "merge.radius", merge.radius,
            "must be finite and > 0")  # fmt: skip
    require(isinstance(merge.iterations, int) and merge.iterations >= 1, "merge.iterations",
            merge.iterations, "must be an integer >= 1")  # fmt: skip


def _rows(v_R: jax.Array, like: jax.Array) -> jax.Array:
    """``v_R`` (``[R]``) shaped to broadcast against ``like`` (``[R, ...]``)."""
    return v_R.reshape(-1, *([1] * (like.ndim - 1)))


def median_of(v_R: jax.Array, valid_R: jax.Array) -> jax.Array:
    """The median of the counted entries of ``v_R`` (``[R]``; an even count: the mean of the
    two middle ones), unweighted; 0 when none counts."""
    n = jnp.sum(valid_R.astype(jnp.int32))
    s = jnp.sort(jnp.where(valid_R, v_R.astype(jnp.float32), jnp.inf))
    lo, hi = s[jnp.maximum((n - 1) // 2, 0)], s[jnp.maximum(n // 2, 0)]
    return jnp.where(n > 0, 0.5 * (lo + hi), 0.0)


class Lazy(Sequence):
    """``fn(i)`` for ``i`` in ``range(count)``, computed when read, each time: a list of leaves
    that is never held whole (the syncer's pushes, read from their files leaf by leaf, or the
    clipped values of the leaves)."""

    def __init__(self, size: int, fn: Callable[[int], Any]):
        self.size, self.fn = size, fn

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.fn(j) for j in range(self.size)[i]]
        if not -self.size <= i < self.size:
            raise IndexError(i)
        return self.fn(i % self.size)


def norms(leaves_R: Sequence, valid_R: jax.Array) -> jax.Array:
    """Each contributor's float32 norm over every leaf (``[R]``; 0 for one not counted)."""
    sq_R = sum(jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1), axis=1)
               for x in leaves_R)  # fmt: skip
    return jnp.where(valid_R, jnp.sqrt(sq_R), 0.0)


def clip_scales(norms_R: jax.Array, valid_R: jax.Array, clip: float) -> jax.Array:
    """The factor each pseudo-gradient is scaled by before the rule: ``min(1, clip x the
    median counted norm / its norm)`` (``[R]``; 1 where ``clip`` is 0 or the norm is 0)."""
    if not clip:
        return jnp.ones(norms_R.shape, jnp.float32)
    radius = clip * median_of(norms_R, valid_R)
    return jnp.where(norms_R > radius, radius / jnp.maximum(norms_R, 1e-30), 1.0)


def _sorted(x_R: jax.Array, w_R: jax.Array, valid_R: jax.Array):
    """Each coordinate's counted values in ascending order (the others last, as +inf) and
    their weights (0 for the others); ties keep contributor order."""
    counted = _rows(valid_R, x_R)
    key = jnp.where(counted, x_R.astype(jnp.float32), jnp.inf)
    order = jnp.argsort(key, axis=0, stable=True)
    w = jnp.broadcast_to(_rows(jnp.where(valid_R, w_R, 0.0).astype(jnp.float32), x_R), x_R.shape)
    return jnp.take_along_axis(key, order, axis=0), jnp.take_along_axis(w, order, axis=0)


def _ordered(terms_R: jax.Array) -> jax.Array:
    """``sum_r terms_R[r]`` added in order (the same float32 sums on every layout)."""
    return compress.fold(lambda r, acc: acc + terms_R[r], terms_R.shape[0],
                         jnp.zeros(terms_R.shape[1:], jnp.float32))  # fmt: skip


def weighted_mean(x_R: jax.Array, w_R: jax.Array, valid_R: jax.Array) -> jax.Array:
    """``sum_r w_r x_r / sum_r w_r`` over the counted, in float32 and contributor order."""
    w = jnp.where(valid_R, w_R, 0.0).astype(jnp.float32)
    terms = jnp.where(_rows(valid_R, x_R), _rows(w, x_R) * x_R.astype(jnp.float32), 0.0)
    total = compress.fold(lambda r, acc: acc + w[r], w.shape[0], jnp.zeros([], jnp.float32))
    return _ordered(terms) * (1.0 / jnp.maximum(total, 1e-30))


def trimmed_mean(x_R: jax.Array, w_R: jax.Array, valid_R: jax.Array, trim: int) -> jax.Array:
    """Coordinate-wise: the ``trim`` smallest and largest counted values dropped (at most
    ``(n - 1) // 2`` each side), the rest's weighted mean."""
    s, w = _sorted(x_R, w_R, valid_R)
    n = jnp.sum(valid_R.astype(jnp.int32))
    f = jnp.minimum(trim, jnp.maximum(n - 1, 0) // 2)
    k = _rows(jnp.arange(x_R.shape[0]), x_R)
    kept = (k >= f) & (k < n - f)
    w = jnp.where(kept, w, 0.0)
    total = _ordered(w)
    return _ordered(jnp.where(kept, w * s, 0.0)) / jnp.maximum(total, 1e-30)


def weighted_median(x_R: jax.Array, w_R: jax.Array, valid_R: jax.Array) -> jax.Array:
    """Coordinate-wise weighted median (see the module's docstring); 0 when none counts."""
    s, w = _sorted(x_R, w_R, valid_R)
    cumulative = jnp.cumsum(w, axis=0)
    half = 0.5 * cumulative[-1]
    lo = jnp.argmax(cumulative >= half, axis=0)
    hi = jnp.argmax(cumulative > half, axis=0)
    pick = lambda i: jnp.take_along_axis(s, i[None], axis=0)[0]  # noqa: E731
    return jnp.where(cumulative[-1] > 0, 0.5 * (pick(lo) + pick(hi)), 0.0)


def centered_clip(leaves_R: Sequence, w_R: jax.Array, valid_R: jax.Array, center: list,
                  radius: float, iterations: int) -> list:  # fmt: skip
    """Centered clipping from ``center`` (a list of leaves, float32), ``iterations`` steps;
    see the module's docstring. Each step reads ``leaves_R`` twice, leaf by leaf."""
    w = jnp.where(valid_R, w_R, 0.0).astype(jnp.float32)
    total = compress.fold(lambda r, acc: acc + w[r], w.shape[0], jnp.zeros([], jnp.float32))
    share = w * (1.0 / jnp.maximum(total, 1e-30))
    v = [c.astype(jnp.float32) for c in center]
    for _ in range(iterations):

        def diff_of(i, v=v):
            x = leaves_R[i]
            return jnp.where(_rows(valid_R, x), x.astype(jnp.float32) - v[i][None], 0.0)

        diff = Lazy(len(v), diff_of)
        dist = norms(diff, valid_R)
        tau = radius * median_of(dist, valid_R)
        step = share * jnp.where(dist > tau, tau / jnp.maximum(dist, 1e-30), 1.0)
        v = [c + _ordered(_rows(step, d) * d) for c, d in zip(v, diff, strict=True)]
    return v


def combine(merge: Merge, leaves_R: Sequence, w_R: jax.Array, valid_R: jax.Array,
            center: list | None = None) -> list:  # fmt: skip
    """The merged pseudo-gradient (a list of float32 leaves) of ``R`` contributors' leaves
    ``leaves_R`` (each ``[R, ...]``; a list, or a :class:`Lazy` one read leaf by leaf), as
    ``merge`` says: the clipping first (norms over all the leaves), then the rule
    (``center``: centered clipping's, zeros when None). Only the counted rows are read (the
    result is the same whatever the others hold, or without them)."""
    scale_R = clip_scales(norms(leaves_R, valid_R), valid_R, merge.clip)
    if merge.clip:
        raw = leaves_R
        leaves_R = Lazy(len(raw), lambda i: raw[i].astype(jnp.float32) * _rows(scale_R, raw[i]))
    if merge.rule == "centered_clip":
        if center is None:
            center = [jnp.zeros(leaves_R[i].shape[1:]) for i in range(len(leaves_R))]
        return centered_clip(leaves_R, w_R, valid_R, center, merge.radius, merge.iterations)
    if merge.rule == "trimmed_mean":
        return [trimmed_mean(x, w_R, valid_R, merge.trim) for x in leaves_R]
    if merge.rule == "median":
        return [weighted_median(x, w_R, valid_R) for x in leaves_R]
    return [weighted_mean(x, w_R, valid_R) for x in leaves_R]


def diagnose(merge: Merge, leaves_R: Sequence, w_R: jax.Array, valid_R: jax.Array,
             merged: list) -> dict[str, jax.Array]:  # fmt: skip
    """What the merge did to each contributor (each ``[R]``): its pseudo-gradient's ``norm``,
    its ``distance`` to the ``merged`` result, whether its norm was ``clipped`` (``merge.clip``)
    and, for the trimmed mean, the share of its coordinates ``trimmed`` (else 0). One more
    read of the leaves; for a syncer's tape and status page."""
    norm_R = norms(leaves_R, valid_R)
    clipped = clip_scales(norm_R, valid_R, merge.clip) < 1.0
    diff = Lazy(len(merged), lambda i: jnp.where(_rows(valid_R, leaves_R[i]), leaves_R[i].astype(
        jnp.float32) - merged[i][None], 0.0))  # fmt: skip
    distance = norms(diff, valid_R)
    trimmed = jnp.zeros(norm_R.shape, jnp.float32)
    if merge.rule == "trimmed_mean":
        scale_R = clip_scales(norm_R, valid_R, merge.clip)
        n = jnp.sum(valid_R.astype(jnp.int32))
        f = jnp.minimum(merge.trim, jnp.maximum(n - 1, 0) // 2)
        size = 0
        for x in leaves_R:
            key = jnp.where(_rows(valid_R, x), x.astype(jnp.float32) * _rows(scale_R, x), jnp.inf)
            rank = jnp.argsort(jnp.argsort(key, axis=0, stable=True), axis=0)  # each row's place
            out = (rank < f) | (rank >= n - f)
            trimmed = trimmed + jnp.sum(out.reshape(out.shape[0], -1), axis=1)
            size += x[0].size
        trimmed = jnp.where(valid_R, trimmed / max(size, 1), 0.0)
    return {"norm": norm_R, "distance": distance, "clipped": clipped & valid_R, "trimmed": trimmed}


def exchange(axis_name: compress.AxisName, merge: Merge, attack: Attack | None = None):
    """An :class:`~diloco_jax.algorithm.exchange.Exchange` merging with ``merge``: every
    replica's weighted pseudo-gradient gathered in replica order, ``attack``'s hostile rows
    replaced (:func:`attacked`) and :func:`combine` applied (the same inputs on every replica,
    so the same result). State, per replica and the same on each: ``(center, syncs)``, centered
    clipping's center (the last merge's float32 result, else ``()``) and the int32 syncs so far
    (the gaussian attack's key)."""
    from diloco_jax.algorithm.exchange import Exchange

    attack = attack or Attack()

    def init(leaves):
        center = [jnp.zeros(x.shape, jnp.float32) for x in leaves]
        return (center if merge.rule == "centered_clip" else (), jnp.zeros([], jnp.int32))

    def mean(delta, w, finite, state, anchor=None) -> tuple[list, Any, jax.Array]:
        center, count = state
        counted = w > 0
        sent = [jnp.where(counted, d, 0.0) for d in delta]  # a left-out replica's NaN stays home
        leaves_R, w_R, valid_R = compress.gather_in_order((sent, w, counted), axis_name)
        for name in compress.names(axis_name):  # the same on every replica: its max is it, and
            count = lax.pmax(count, name)  # not per replica (what it moves is shared)
            if merge.rule == "centered_clip":
                center = [lax.pmax(c, name) for c in center]
        leaves_R, w_R = attacked(attack, leaves_R, w_R, valid_R, count)
        out = combine(merge, leaves_R, w_R, valid_R, center or None)
        total_w = compress.fold(lambda r, acc: acc + w_R[r], w_R.shape[0], jnp.zeros_like(w))
        if merge.rule == "centered_clip":  # a sync nobody joined keeps the old center
            center = [jnp.where(total_w > 0, o, c) for o, c in zip(out, center, strict=True)]
        out = [o.astype(d.dtype) for o, d in zip(out, delta, strict=True)]
        return out, (center, count + 1), total_w

    return Exchange(init, mean)
