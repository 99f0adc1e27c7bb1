"""The baselines, with DiLoCo's interface (``kinds``, ``init``, ``update``, ``outer_params``):

* :func:`data_parallel`: synchronous data parallelism: R replicas average their gradients
  every step, then take the inner step (the ``ddp`` baseline).
* :func:`single`: one replica with the inner optimizer alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm.exchange import AxisName, replica_mean
from diloco_jax.algorithm.state import PER_REPLICA, SHARED, declare


class LocalState(NamedTuple):
    """``step``: int32 scalar, shared; ``params`` and ``inner_state``: per replica (with data
    parallelism every replica holds the same values; they stay per replica so that nothing
    differentiated is replicated over the replica axis)."""

    step: jax.Array
    params: Any
    inner_state: Any


class Local(NamedTuple):
    """Every replica steps ``inner``; with an ``axis_name`` the gradients are averaged first."""

    inner: optax.GradientTransformation
    axis_name: AxisName | None = None

    @property
    def kinds(self) -> LocalState:
        return declare(LocalState, SHARED, PER_REPLICA, PER_REPLICA)

    def init(self, params) -> LocalState:
        return LocalState(jnp.zeros([], jnp.int32), params, self.inner.init(params))

    def update(self, state: LocalState, grads, *, active=True, weight=1.0, take_anchor=True,
               outer_scale=1.0):  # fmt: skip
        """One step; the simulator's straggler and failure controls (and an outer learning
        rate, which these have not) do not apply."""
        del active, weight, take_anchor, outer_scale
        if self.axis_name is not None:
            grads = replica_mean(grads, self.axis_name)
        updates, inner_state = self.inner.update(grads, state.inner_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return LocalState(state.step + 1, params, inner_state), {}

    def outer_params(self, stacked: LocalState) -> Any:
        """Replica 0's parameters."""
        return jax.tree.map(lambda x: x[0], stacked.params)


def data_parallel(inner: optax.GradientTransformation, *, axis_name: AxisName = "replica"):
    """Synchronous data parallelism over ``axis_name``: the same training code as DiLoCo."""
    return Local(inner, axis_name)


def single(inner: optax.GradientTransformation) -> Local:
    """One replica, the inner optimizer only."""
    return Local(inner, None)
