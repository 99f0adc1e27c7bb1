"""Timing whole train calls of several setups, alternating, for the ``bench_*.py`` scripts."""

from __future__ import annotations

import time

import jax


def time_calls(runs: dict, *, calls: int, rounds: int) -> dict[str, list[float]]:
    """Seconds of each whole call, per run: ``runs[name]`` is ``[cfg, setup, compiled, control,
    state, ...]``; each call runs ``compiled(state, replicas, training data, control)`` to its
    result and keeps the new state. The runs' calls alternate, so machine noise hits all alike."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for _ in range(calls):
            for name, run in runs.items():
                _, s, compiled, control, state = run[:5]
                tick = time.perf_counter()
                state, metrics = compiled(state, s.replicas_R, s.shards_RxS, control)
                jax.block_until_ready(metrics)
                seconds[name].append(time.perf_counter() - tick)
                run[4] = state
    return seconds
