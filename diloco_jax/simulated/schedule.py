"""Who computes and who communicates at each step: stragglers and failures as masks.

Everything here is host-side numpy and a pure function of the config, the seed and the step, so
the compiled step stays one function and a resumed run sees the same schedule. The masks feed
:class:`diloco_jax.runtime.step.StepControl` (``[N, R]`` for a call of N steps).

* Speeds: replica ``r`` computes at ``speeds[r]`` relative speed. With fixed ``sync_every`` every
  replica takes every step (fast ones then wait at the sync: see ``sim/clock.py``). With Dynamic
  Local Updates (DyLU, Liu et al., 2024, arXiv 2401.09135) replica ``r`` takes
  ``H_r = max(1, floor(sync_every * speeds[r] / max(speeds)))`` steps per round and its
  pseudo-gradient is weighted by ``H_r / sync_every`` in the mean.
* Failures: at outer step ``k`` (0-based: the sync ending round ``k``) a replica may be dropped,
  by a schedule ``r:a-b`` (dropped for ``a <= k < b``) or independently with probability ``p``
  (drawn from ``(seed, k)``). A dropped replica is left out of the mean and keeps its own
  parameters (DiLoCo paper, Fig. 8). At the next sync where it is connected its parameters are
  relative to an old anchor, so it is still left out of the mean but restarts from the anchor.
* Quorum and grace (after Decoupled DiLoCo, Douillard et al., 2026, arXiv 2604.21428): a sync
  does not wait for every replica (:func:`quorum_rounds`). It proceeds once ``quorum`` replicas
  have finished their round, after a grace window for more; a late replica keeps training on its
  own parameters and merges at the next sync, its pseudo-gradient measured from the anchor it
  started from (DiLoCo's ``late_merge``) and weighted by its tokens since.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from diloco_jax.algorithm import SyncPlan


def parse_speeds(text: str, replicas: int) -> np.ndarray:
    """``"1,0.5,..."`` -> float64 ``[R]`` (all ones for ``""``)."""
    if not text.strip():
        return np.ones(replicas)
    try:
        speeds = np.array([float(x) for x in text.split(",")])
    except ValueError:
        raise ValueError(f"config key sim.speeds = {text!r} is invalid: not numbers") from None
    if len(speeds) != replicas or (speeds <= 0).any():
        raise ValueError(
            f"config key sim.speeds = {text!r} is invalid: needs {replicas} positive numbers "
            "(one per replica)"
        )
    return speeds


def parse_drops(text: str, replicas: int) -> list[tuple[int, int, int]]:
    """``"r:a-b;..."`` -> ``[(r, a, b), ...]``."""
    drops = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        try:
            replica, span = item.split(":")
            first, end = span.split("-")
            r, a, b = int(replica), int(first), int(end)
        except ValueError:
            raise ValueError(
                f"config key sim.drop = {text!r} is invalid: use 'replica:first-end;...' "
                "(e.g. '1:2-5' drops replica 1 for outer steps 2, 3 and 4)"
            ) from None
        if not (0 <= r < replicas and 0 <= a < b):
            raise ValueError(
                f"config key sim.drop = {text!r} is invalid: item {item!r} needs "
                f"0 <= replica < {replicas} and 0 <= first < end"
            )
        drops.append((r, a, b))
    return drops


def needs_control(*, speeds: str, dylu: bool, drop: str, drop_prob: float,
                  quorum: int = 0) -> bool:  # fmt: skip
    """Whether any mask can differ from plain DiLoCo (else the step skips the masking work)."""
    return bool(speeds.strip() or dylu or drop.strip() or drop_prob > 0 or quorum > 0)


class QuorumRounds(NamedTuple):
    """What each round ``k`` of :func:`quorum_rounds` does (arrays ``[K, R]`` and ``[K]``)."""

    steps: np.ndarray  # int: inner steps replica r takes in round k (<= sync_every)
    weight: np.ndarray  # float32: its weight at sync k (tokens since its base / a round's; 0: late)
    merged: np.ndarray  # bool: it joins sync k and restarts from the new anchor
    wall: np.ndarray  # float64: round k's length in step times of a speed-1 replica


@functools.lru_cache(maxsize=16)
def _quorum_rounds(speeds: tuple, sync_every: int, quorum: int, grace: float, rounds: int):
    speeds_R, H = np.asarray(speeds), sync_every
    carried_R = np.zeros(len(speeds_R))  # steps since the replica's base anchor
    late_R = np.zeros(len(speeds_R), bool)
    steps, weight, merged = (np.zeros((rounds, len(speeds_R)), t) for t in (int, np.float32, bool))
    out = QuorumRounds(steps, weight, merged, np.zeros(rounds))
    for k in range(rounds):
        arrive_R = np.maximum(0.0, H - carried_R) / speeds_R  # its own round of H steps done
        ready = np.sort(arrive_R)[quorum - 1]
        wall = min(arrive_R.max(), ready + grace * H)
        steps_R = np.minimum(H, np.floor(speeds_R * wall + 1e-9)).astype(int)
        merged_R = (arrive_R <= wall + 1e-9) | late_R
        done_R = carried_R + steps_R
        out.steps[k], out.merged[k], out.wall[k] = steps_R, merged_R, wall
        out.weight[k] = np.where(merged_R, done_R / H, 0.0)
        carried_R, late_R = np.where(merged_R, 0.0, done_R), ~merged_R
    return out


def quorum_rounds(speeds: np.ndarray, sync_every: int, quorum: int, grace: float,
                  rounds: int) -> QuorumRounds:  # fmt: skip
    """The first ``rounds`` rounds of DiLoCo with a quorum and a grace window.

    Time counts in step times of a speed-1 replica; replica ``r`` takes a step every
    ``1 / speeds[r]``. Each replica owes ``sync_every`` (H) steps since it last restarted from
    the anchor; it *arrives* when it has taken them. In round ``k``:

    * ``ready`` = when the ``quorum``-th replica arrives; the sync happens at
      ``wall = min(last arrival, ready + grace * H)``;
    * every replica computes until the sync (``min(H, floor(speeds[r] * wall))`` steps; one that
      arrives early waits at the barrier), so a round is at most H steps of the sync plan;
    * those that arrived join the sync, and so does every replica that was late at the last one:
      a late replica merges at the next sync whatever it has done. Each joins with weight = its
      steps since its base anchor / H (its tokens, as a share of a round's) and restarts from
      the new anchor;
    * the others are late: they keep training on their own parameters into the next round.

    ``quorum`` >= R is plain DiLoCo waiting for everyone (every weight 1). Pure function of its
    arguments (a resumed run sees the same rounds).
    """
    quorum = min(max(quorum, 1), len(speeds))
    # rounds are a prefix of longer runs': computed for the next power of two and cached, so a
    # run asking call after call for one round more recomputes only when it doubles
    computed = 1 << max(rounds - 1, 0).bit_length()
    whole = _quorum_rounds(tuple(float(s) for s in speeds), sync_every, quorum, float(grace),
                           computed)  # fmt: skip
    return QuorumRounds(*(x[:rounds] for x in whole))


def local_steps(speeds: np.ndarray, sync_every: int, dylu: bool) -> np.ndarray:
    """Inner steps each replica takes per round: ``sync_every`` or, with DyLU, ``H_r``."""
    if not dylu:
        return np.full(len(speeds), sync_every)
    return np.maximum(1, np.floor(sync_every * speeds / speeds.max() + 1e-9)).astype(int)


def connected(outer_step: int, *, replicas: int, drops, drop_prob: float, seed: int) -> np.ndarray:
    """bool ``[R]``: which replicas take part in the sync ending round ``outer_step``."""
    up = np.ones(replicas, bool)
    for r, a, b in drops:
        if a <= outer_step < b:
            up[r] = False
    if drop_prob > 0:
        rng = np.random.default_rng([seed, outer_step, 0x5EED])
        up &= rng.random(replicas) >= drop_prob
    return up


def control(
    start: int,
    num_steps: int,
    *,
    replicas: int,
    plan: SyncPlan,
    speeds: np.ndarray,
    dylu: bool,
    drops,
    drop_prob: float,
    seed: int,
    quorum: int = 0,
    grace: float = 0.0,
) -> dict[str, np.ndarray]:
    """The ``StepControl`` fields for steps ``start .. start + num_steps - 1`` (0-based: index
    ``t`` is inner step ``t + 1`` of ``plan``) as ``[N, R]``. DyLU and failures act on whole
    rounds, so they need a ``plan`` that does not stream (the config refuses the combination);
    without them every replica takes every step with weight 1. ``quorum > 0``: the rounds of
    :func:`quorum_rounds` (which excludes DyLU and failures: the config refuses them together)."""
    sync_every = plan.sync_every
    steps_R = local_steps(speeds, sync_every, dylu)
    # weights proportional to steps taken, 1.0 for a full round (so equal speeds give plain DiLoCo)
    weight_R = (steps_R / sync_every).astype(np.float32)
    active = np.ones((num_steps, replicas), bool)
    weight = np.ones((num_steps, replicas), np.float32)
    take_anchor = np.ones((num_steps, replicas), bool)
    masks = {"active": active, "weight": weight, "take_anchor": take_anchor,
             "outer_scale": np.ones((num_steps, replicas), np.float32),
             "seed": np.full((num_steps, replicas), seed, np.int32)}  # fmt: skip
    kw = dict(replicas=replicas, drops=drops, drop_prob=drop_prob, seed=seed)
    if quorum > 0:
        last = (start + num_steps - 1) // sync_every  # the round of the call's last step
        rounds = quorum_rounds(speeds, sync_every, quorum, grace, last + 1)
        for i, t in enumerate(range(start, start + num_steps)):
            k = t // sync_every
            active[i] = t % sync_every < rounds.steps[k]
            if plan.starting(t + 1)[0]:
                weight[i], take_anchor[i] = rounds.weight[k], rounds.merged[k]
        return masks
    if not (dylu or drops or drop_prob > 0):
        return masks
    if plan.streaming:
        raise ValueError("DyLU and failure schedules need a sync plan without streaming")
    for i, t in enumerate(range(start, start + num_steps)):
        active[i] = t % sync_every < steps_R
        if plan.starting(t + 1)[0]:
            k = plan.rounds(t + 1) - 1  # the outer step this sync makes
            up = connected(k, **kw)
            was_up = connected(k - 1, **kw) if k > 0 else np.ones(replicas, bool)
            weight[i] = weight_R * (up & was_up)
            take_anchor[i] = up
    return masks
