"""A network clock: simulated wall-clock and compute utilization of a run.

Each replica computes one inner step in ``step_time / speed_r`` seconds on its own device; a
reduce of ``P`` bytes takes :func:`diloco_jax.simulated.comms.reduce_seconds` over the network.
Replicas work in rounds that end at a sync, and everyone waits for the slowest:

    round time = max_r(steps_r * step_time / speed_r) + reduce time
    utilization = sum over replicas and rounds of compute time / (R * wall-clock)

With fixed ``sync_every`` every replica takes ``sync_every`` steps per round (fast ones idle at
the barrier); with Dynamic Local Updates slow replicas take fewer (``schedule.local_steps``).
``ddp`` is the same with a round of one step; ``single`` never waits. With a quorum (Decoupled
DiLoCo) a round ends when ``schedule.quorum_rounds`` says, and only the replicas that join a sync
take part in its reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from diloco_jax.algorithm.plan import SyncPlan
from diloco_jax.simulated import comms, schedule


class Clock(NamedTuple):
    wallclock_s: float
    compute_s: float  # summed over replicas
    comm_s: float  # time the replicas stall in reduces (all of it unless overlapped)
    utilization: float  # compute_s / (replicas * wallclock_s)


def simulate(
    *,
    algorithm: str,
    steps: int,
    sync_every: int,
    replicas: int,
    speeds: np.ndarray,
    dylu: bool,
    step_time_s: float,
    payload_bytes: int | Sequence[int],
    network: comms.Network,
    topology: str = "ring",
    fragments: int = 1,
    hidden_steps: int = 0,
    extra_payloads: Sequence[tuple[int, int]] = (),
    quorum: tuple[int, float] | None = None,
) -> Clock:
    """The wall-clock of ``steps`` inner steps per replica under the model above.

    Streaming DiLoCo syncs one of its ``fragments`` every ``sync_every / fragments`` steps,
    fragment ``k mod F`` at the end of round ``k``, with the fragments' ``payload_bytes`` (a list)
    in turn. Overlapped communication: a reduce runs behind ``hidden_steps`` inner steps of compute
    (streaming's overlap tau; a whole round for delayed and eager outer steps) and only what
    exceeds them stalls the replicas. ``comm_s`` is the stalled time. ``extra_payloads``:
    ``(every, P)`` reduces that join the sync after each inner step that ``every`` divides
    (DES-LOC's moment averages). ``quorum``: DiLoCo's ``(quorum, grace)`` (:func:`_quorum`).
    """
    payloads = [payload_bytes] if isinstance(payload_bytes, int) else list(payload_bytes)
    reduce_s = [comms.reduce_seconds(p, replicas, network, topology) for p in payloads]
    if algorithm == "single":
        compute = steps * step_time_s / speeds[0]
        return Clock(compute, compute, 0.0, 1.0)
    if quorum is not None and algorithm == "diloco":
        return _quorum(steps, sync_every, speeds, step_time_s, payloads[0], network, topology,
                       *quorum)  # fmt: skip
    round_steps = 1 if algorithm == "ddp" else SyncPlan(sync_every, fragments).period
    per_round = schedule.local_steps(speeds, round_steps, dylu and algorithm == "diloco")
    full_rounds, leftover = divmod(steps, round_steps)
    compute_R = per_round * step_time_s / speeds
    extra_s = [(every, comms.reduce_seconds(p, replicas, network, topology))
               for every, p in extra_payloads]  # fmt: skip

    def stall(k: int) -> float:  # after round k, at inner step k * round_steps
        extra = sum(t for every, t in extra_s if (k * round_steps) % every == 0)
        return max(0.0, reduce_s[k % len(reduce_s)] + extra - hidden_steps * step_time_s)

    comm = sum(stall(k) for k in range(1, full_rounds + 1))
    wall = full_rounds * compute_R.max() + comm
    busy = full_rounds * compute_R.sum()
    if leftover:  # a last round that ends before its sync
        left_R = np.minimum(per_round, leftover) * step_time_s / speeds
        wall += left_R.max()
        busy += left_R.sum()
    return Clock(float(wall), float(busy), float(comm), float(busy / (replicas * wall)))


def _quorum(steps, sync_every, speeds, step_time_s, payload, network, topology, quorum, grace):
    """The clock of rounds that end at a quorum (``schedule.quorum_rounds``): round ``k`` lasts
    its ``wall`` step times, then the replicas that join its sync reduce among themselves; the
    last round, if unfinished, ends with the slowest of its steps."""
    full, leftover = divmod(steps, sync_every)
    rounds = schedule.quorum_rounds(speeds, sync_every, quorum, grace, full + bool(leftover))
    comm = sum(comms.reduce_seconds(payload, int(m.sum()), network, topology)
               for m in rounds.merged[:full])  # fmt: skip
    busy_KxR = rounds.steps / speeds * step_time_s
    wall = rounds.wall[:full].sum() * step_time_s + comm
    if leftover:
        busy_KxR[-1] = np.minimum(rounds.steps[-1], leftover) / speeds * step_time_s
        wall += busy_KxR[-1].max()
    busy = busy_KxR.sum()
    return Clock(float(wall), float(busy), float(comm), float(busy / (len(speeds) * wall)))
