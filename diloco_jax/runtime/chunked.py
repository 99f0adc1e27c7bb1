"""The simulator in chunks: more virtual replicas than fit on the device at once.

``sim.chunk = K``: the inner steps of the ``R`` replicas run ``K`` at a time (the one replica
step under ``jax.vmap`` over ``K``, ``lax.scan`` over the steps up to the next sync), one chunk
after another, so the device holds one chunk's activations, not ``R``'s. A sync needs every
replica's pseudo-gradient, so it runs once over all ``R``: the same step under ``vmap`` over
``R`` with no inner step (``active=False``, zero gradients: the algorithm's own sync, every
exchange, timing and statistic unchanged) and no activations.

``sim.offload``: between chunks the replica-stacked state lives in host memory (numpy) and each
chunk's part comes to the device for its steps and goes back; the sync runs on the host's CPU
device. R is then bounded by host memory. (On a CPU-only machine host and device are the same
memory; the round trip is still taken, and must not change a bit.)

Equals the all-at-once ``vmap`` to float rounding (XLA rounds a model's gradients differently
for other vmap sizes; a quadratic's elementwise gradients are bitwise alike).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.algorithm import state as state_lib
from diloco_jax.base.axes import REPLICA
from diloco_jax.runtime.step import StepControl, scan_steps


class LocalOnly(NamedTuple):
    """``algorithm`` with its syncs left out: :meth:`update` takes the inner step alone."""

    algorithm: Any

    @property
    def kinds(self):
        return self.algorithm.kinds

    def update(self, state, grads, **control):
        return self.algorithm.update(state, grads, sync=False, **control)


def _segments(start: int, num_steps: int, plan) -> list[tuple[int, int, bool]]:
    """``(first, end, syncs)`` index ranges of a call's steps, cut after every sync step."""
    cuts = [s - start for s, _ in plan.sync_steps(start + 1, start + num_steps)]
    out, first = [], 0
    for end in cuts:
        out.append((first, end, True))
        first = end
    if first < num_steps:
        out.append((first, num_steps, False))
    return out


def _index(tree, idx):
    return jax.tree.map(lambda x: x[idx], tree)


class _Memory(NamedTuple):
    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int


class ChunkedSteps:
    """``run(state, replicas_R, shards_R, control_NxR) -> (state, metrics_NxR)`` as
    :func:`diloco_jax.runtime.parallel.simulator_steps` computes it, in chunks of ``chunk``
    replicas. ``local_step``: the replica step of :class:`LocalOnly` ``(algorithm)``."""

    def __init__(self, local_step, algorithm, num_steps: int, *, chunk: int, offload: bool,
                 per_step_data: bool = False):  # fmt: skip
        self.algorithm, self.num_steps, self.chunk, self.offload = (
            algorithm, num_steps, chunk, offload)  # fmt: skip
        self.per_step_data = per_step_data
        kinds = algorithm.kinds
        self.axes = state_lib.vmap_axes(kinds)
        self.kinds = kinds
        step_K = jax.vmap(local_step, in_axes=(self.axes, 0, 0, 0), out_axes=(self.axes, 0),
                          axis_name=REPLICA)  # fmt: skip
        # no donation: every chunk's call takes the same shared leaves (anchor, outer state)
        self._local = functools.cache(
            lambda n: jax.jit(scan_steps(step_K, n, per_step_data=per_step_data))
        )
        sync_R = jax.vmap(self._sync_one, in_axes=(self.axes, 0), out_axes=(self.axes, 0),
                          axis_name=REPLICA)  # fmt: skip
        self._sync = jax.jit(sync_R, donate_argnums=0)
        self._ahead: dict = {}  # steps -> the chunk call compiled by lower()
        self.device = jax.local_devices()[0]
        self.host = jax.local_devices(backend="cpu")[0]

    def _sync_one(self, state, control: StepControl):
        """The sync of one replica after inner step ``state.step``: the algorithm's update with
        no inner step, from ``step - 1``."""
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        state = state._replace(step=state.step - 1)
        return self.algorithm.update(state, zeros, active=False, weight=control.weight,
                                     take_anchor=control.take_anchor,
                                     outer_scale=control.outer_scale)  # fmt: skip

    def _cut(self, state, part: slice):
        """The chunk ``part`` of ``state``: per-replica leaves sliced, shared ones whole."""
        return self._by_kind(lambda sub: jax.tree.map(lambda x: x[part], sub), lambda sub: sub,
                             state)  # fmt: skip

    def _take(self, state, part: slice):
        """The chunk ``part`` of ``state``, on the device."""
        cut = self._cut(state, part)
        return jax.device_put(cut, self.device) if self.offload else cut

    def on_device(self, state):
        """The shapes of what the device holds of ``state`` during a call: one chunk's part
        with ``offload`` (the rest waits in host memory), else all of it (the memory plan)."""
        if not self.offload:
            return state
        return jax.eval_shape(lambda st: self._cut(st, slice(0, self.chunk)), state)

    def _join(self, parts: list):
        """The chunks' states as one replica-stacked state (shared leaves: the last chunk's,
        equal in every chunk), in host memory with ``offload``."""

        state = self._by_kind(lambda *subs: jax.tree.map(lambda *xs: self._concat(xs), *subs),
                              lambda *subs: subs[-1], *parts)  # fmt: skip
        return jax.tree.map(np.asarray, state) if self.offload else state

    def _by_kind(self, per_replica, shared, *states):
        """``per_replica(*fields)`` or ``shared(*fields)`` on each field of ``states``, as the
        algorithm's kinds declare it."""
        return jax.tree.map(
            lambda kind, *subs: (per_replica if kind == state_lib.PER_REPLICA else shared)(*subs),
            self.kinds, *states, is_leaf=lambda k: isinstance(k, str),
        )  # fmt: skip

    def _concat(self, xs):
        return np.concatenate([np.asarray(x) for x in xs]) if self.offload else jnp.concatenate(xs)

    def _chunks(self, state, replicas_R, shards_R, control_NxR, first: int, end: int):
        """Steps ``first .. end - 1`` of the call, inner steps only, one chunk after another."""
        control = _index(control_NxR, slice(first, end))
        parts, metrics = [], []
        for c in range(0, int(replicas_R.shape[0]), self.chunk):
            part = slice(c, c + self.chunk)
            run = self._ahead.get(end - first) or self._local(end - first)
            sub, m = run(
                self._take(state, part), replicas_R[part], self._data(shards_R, first, end, part),
                _index(control, (slice(None), part)),
            )  # fmt: skip
            parts.append(sub)
            metrics.append(m)
        return self._join(parts), jax.tree.map(lambda *ms: jnp.concatenate(ms, axis=1), *metrics)

    def __call__(self, state, replicas_R, shards_R, control_NxR):
        if self.offload:
            state = jax.tree.map(np.asarray, state)
        start = int(np.asarray(state.step))
        rows: list = []
        for first, end, syncs in _segments(start, self.num_steps, self.algorithm.plan):
            state, metrics = self._chunks(state, replicas_R, shards_R, control_NxR, first, end)
            if syncs:  # over every replica at once: no activations, only the state
                on = self.host if self.offload else self.device
                state, stats = self._sync(jax.device_put(state, on),
                                          _index(control_NxR, end - 1))  # fmt: skip
                metrics = {k: v.at[-1].set(stats[k]) if k in stats else v
                           for k, v in metrics.items()}  # fmt: skip
                if self.offload:
                    state = jax.tree.map(np.asarray, state)
            rows.append(metrics)
        metrics = jax.tree.map(lambda *ms: jnp.concatenate(ms, axis=0), *rows)
        if self.offload:  # the caller gets device arrays, as from any other step
            state = jax.device_put(state, self.device)
        return state, metrics

    def _data(self, data, first: int, end: int, part: slice):
        """The chunk's data: its shards, or (streamed, ``[N, R, ...]``) its batches of these
        steps."""
        where = (slice(first, end), part) if self.per_step_data else part
        return jax.tree.map(lambda x: x[where], data)

    def lower(self, state, replicas_R, shards_R, control_NxR):
        """Compiles the chunk call and the sync ahead; returns an object whose ``compile()`` is
        this runner, with ``memory_analysis()`` of one chunk's call (its temporaries or the
        sync's, whichever is larger)."""
        part = slice(0, self.chunk)

        def chunk_args(state, replicas_R, shards_R, control_NxR):
            return (self._cut(state, part), replicas_R[part],
                    self._data(shards_R, 0, self.num_steps, part),
                    _index(control_NxR, (slice(None), part)))  # fmt: skip

        # from shapes: works for a built state and for --dry_run's abstract one alike
        args = jax.eval_shape(chunk_args, state, replicas_R, shards_R, control_NxR)
        local = self._local(self.num_steps).lower(*args).compile()
        self._ahead[self.num_steps] = local  # a call of whole num_steps runs it, not a recompile
        control = jax.eval_shape(lambda c: _index(c, 0), control_NxR)
        sync = self._sync.lower(state, control).compile()
        m, s = local.memory_analysis(), sync.memory_analysis()
        assert m is not None and s is not None  # XLA's CPU, GPU and TPU compilers report one
        self._memory = _Memory(m.argument_size_in_bytes, m.output_size_in_bytes,
                               m.alias_size_in_bytes,
                               max(m.temp_size_in_bytes, s.temp_size_in_bytes))  # fmt: skip
        return self

    def compile(self):
        return self

    def memory_analysis(self):
        return self._memory
