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
    """The replica-stacked state of the baselines (:class:`~diloco_jax.algorithm.Local`).

    Attributes:
      step: int32 scalar, shared. Inner steps taken so far.
      params: per replica ``[R, ...]``: each replica's parameters (with data parallelism every
        replica holds the same values; they stay per replica so that nothing differentiated
        is replicated over the replica axis).
      inner_state: per replica: the inner optimizer's state.
    """

    step: jax.Array
    params: Any
    inner_state: Any


class Local(NamedTuple):
    """The baselines, with DiLoCo's interface (``kinds``, ``init``, ``update``,
    ``outer_params``): every replica steps ``inner``; with an ``axis_name`` the gradients are
    averaged over the replicas first. Built by :func:`~diloco_jax.single` and
    :func:`~diloco_jax.data_parallel`.

    Args:
      inner: the optimizer every replica steps.
      axis_name: the named axis (or axes) spanning the replicas, over which the gradients
        are averaged (None: they are not).
    """

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
    """Synchronous data parallelism (the ``ddp`` baseline): the replicas average their
    gradients at every step, then take the inner step, through the same training code as
    DiLoCo.

    Args:
      inner: the optimizer every replica steps.
      axis_name: the named axis (or axes) spanning the replicas.

    Returns:
      A :class:`~diloco_jax.algorithm.Local` with this ``axis_name``.
    """
    return Local(inner, axis_name)


def single(inner: optax.GradientTransformation) -> Local:
    """One replica with the inner optimizer alone (the ``single`` baseline).

    Args:
      inner: the optimizer.

    Returns:
      A :class:`~diloco_jax.algorithm.Local` without an axis name.
    """
    return Local(inner, None)
