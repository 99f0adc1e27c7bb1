"""How replicas average their pseudo-gradients at a sync: small pieces with their own state.

An :class:`Exchange` turns each replica's weighted pseudo-gradient into the replica mean::

    mean = sum_r w_r delta_r / sum_r w_r          (w_r = 0: replica r is left out)

* :func:`plain`: a float32 ``pmean`` (the paper's DiLoCo). No state.
* :func:`encoded`: the pseudo-gradient travels through a codec (:mod:`.compress`);
  with error feedback each replica keeps what its encoding lost and adds it to its next one.
* :func:`dct_momentum`: a local momentum of pseudo-gradients is cut into chunks and transformed
  by a DCT; only the largest components travel and leave the local momentum (DeMo, Peng et al.,
  arXiv 2411.19870, applied to DiLoCo's outer step as in Nedelkoski et al., arXiv 2510.03371).

Every piece is written for one replica under a named axis (or several: the virtual replicas of a
device, then the devices) that spans the replicas; its state is per replica. The exchange sees a
list of leaves (a fragment of the parameters, or all of them). :func:`encoded` and
:func:`dct_momentum` compute the same values on every layout: each replica encodes its own
pseudo-gradient (a virtual replica exactly as a replica on its own device), and every sum over
replicas, of decoded messages, small leaves and weights alike, is taken in float32 in replica
order (:mod:`.compress`), because a lossy codec turns a last-bit difference of its
input into a whole code step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from diloco_jax.algorithm import compress, dct
from diloco_jax.algorithm.state import SHARED

AxisName = compress.AxisName
names = compress.names


def replica_mean(tree: Any, axis_name: AxisName) -> Any:
    """Mean of ``tree`` over the replica axis, which may be several named axes.

    Several names are reduced one after the other (mean of equal-size group means equals the
    global mean). One ``pmean`` over a tuple mixing a ``vmap`` axis and a ``shard_map`` axis is not
    lowered by jax 0.10, so we never ask for one.

    Args:
      tree: a pytree of arrays, this replica's.
      axis_name: the named axis, or a sequence of them (the virtual replicas of a device, then
        the devices), spanning the replicas; call it under ``jax.vmap`` or ``jax.shard_map``
        with these names.

    Returns:
      ``tree``'s mean over the replicas (:func:`jax.lax.pmean` over each name in turn), the
      same on every replica.
    """
    for name in names(axis_name):
        tree = lax.pmean(tree, name)
    return tree


def replica_sum(tree: Any, axis_name: AxisName) -> Any:
    """Sum of ``tree`` over the replica axis (or axes); see :func:`replica_mean`."""
    for name in names(axis_name):
        tree = lax.psum(tree, name)
    return tree


class Exchange(NamedTuple):
    """``init(leaves) -> state`` (per replica); ``mean(delta, w, finite, state, anchor) ->
    (mean, state, total_w)`` where ``delta`` is this replica's list of pseudo-gradient leaves
    (``anchor``: its anchor's; only :mod:`.gossip` reads it), ``w`` its
    weight (0 when left out), ``finite`` whether its pseudo-gradient is finite, ``mean`` the
    weighted replica mean (zeros when every weight is 0) and ``total_w`` the sum (or, for
    :func:`plain`, the mean) of the weights: > 0 when anybody contributed."""

    init: Callable[[list], Any]
    mean: Callable[..., tuple[list, Any, jax.Array]]
    anchor_kind: str = SHARED  # PER_REPLICA: every replica keeps its own anchor (gossip)
    # the messages themselves, decoded elsewhere (:func:`dct_momentum`'s ``messages``)
    messages: Callable[..., tuple] | None = None


def _weighted(delta: list, w: jax.Array) -> list:
    # jnp.where, not w * d: a left-out replica's delta may hold NaN and 0 * NaN is NaN
    return [jnp.where(w > 0, w * d, 0.0) for d in delta]


def _divide(total: list, total_w: jax.Array) -> list:
    # times the reciprocal: XLA rewrites some divisions by a scalar that way and not others,
    # which would make layouts differ in the last bit
    inverse = 1.0 / jnp.maximum(total_w, 1e-30)
    return [t * inverse for t in total]


def plain(axis_name: AxisName) -> Exchange:
    """The float32 weighted mean (two ``pmean``: the weights and the weighted values)."""

    def mean(delta, w, finite, state, anchor=None):
        total_w = replica_mean(w, axis_name)
        return _divide(replica_mean(_weighted(delta, w), axis_name), total_w), state, total_w

    return Exchange(lambda leaves: (), mean)


def _split_big(leaves: list, min_size: int) -> tuple[list[int], list[int]]:
    big = [i for i, x in enumerate(leaves) if x.size >= min_size]
    return big, [i for i in range(len(leaves)) if i not in big]


def _concat(leaves: list, idx: list[int]) -> jax.Array:
    return jnp.concatenate([leaves[i].reshape(-1).astype(jnp.float32) for i in idx])


def _scatter(out: list, leaves: list, idx: list[int], flat: jax.Array) -> None:
    start = 0
    for i in idx:
        out[i] = flat[start : start + leaves[i].size].reshape(leaves[i].shape)
        out[i] = out[i].astype(leaves[i].dtype)
        start += leaves[i].size


def encoded_sum(leaves: list, axis_name: AxisName, codec: compress.Codec) -> tuple[list, list]:
    """``(sum over replicas, what this replica's encoding lost)`` of a list of leaves.

    Leaves of at least ``codec.min_size`` values are concatenated (float32) and travel encoded
    through :func:`compress.compressed_sum`: every replica, virtual or not, encodes its own
    values and keeps its own loss. Smaller leaves are summed in float32 through the same ring
    (:data:`compress.FLOAT32`, replica order) and lose nothing. Both are cast back to each leaf's
    dtype.
    """
    big, small = _split_big(leaves, codec.min_size)
    out_sum, out_lost = list(leaves), list(leaves)
    for idx, how in ((small, compress.FLOAT32), (big, codec)):
        if idx:
            total, loss = compress.compressed_sum(_concat(leaves, idx), axis_name, how)
            _scatter(out_sum, leaves, idx, total)
            _scatter(out_lost, leaves, idx, loss)
    return out_sum, out_lost


def encoded(axis_name: AxisName, codec: compress.Codec) -> Exchange:
    """The weighted mean through ``codec``; state: the error-feedback residual (or ``()``)."""
    feedback = codec.error_feedback

    def init(leaves):
        return [jnp.zeros_like(x) for x in leaves] if feedback else ()

    def mean(delta, w, finite, residual, anchor=None):
        sent = _weighted(delta, w)
        if feedback:  # a replica left out sends nothing and keeps its residual
            sent = [jnp.where(w > 0, s + e, 0.0) for s, e in zip(sent, residual, strict=True)]
        total, lost = encoded_sum(sent, axis_name, codec)
        if feedback:  # a non-finite replica's residual is dropped with the rest of its state
            residual = [jnp.where(w > 0, n, jnp.where(finite, e, 0.0))
                        for n, e in zip(lost, residual, strict=True)]  # fmt: skip
        total_w = compress.ordered_sum(w, axis_name)
        return _divide(total, total_w), residual, total_w

    return Exchange(init, mean)


def dct_momentum(axis_name: AxisName, config: dct.DctConfig) -> Exchange:
    """DCT momentum: per replica ``m <- beta m + w delta``; the ``topk`` largest DCT components
    of each chunk of ``m`` are sent (float32 value and position) and subtracted from ``m``; the
    mean is the inverse DCT of everybody's sent components (added replica by replica,
    :func:`dct.decode_sum`), divided by the total weight (:func:`dct_mean`). Leaves under
    ``config.min_size`` values are averaged in float32 (replica order). State: the float32
    local momentum ``m`` (``[padded size]``, per replica).

    ``messages(delta, w, finite, m) -> (small, messages_R, w_R, m, total_w)``: the same sync
    with the mean left undecoded, for a learner whose syncer decodes it
    (:mod:`diloco_jax.learners.payload`): ``small`` the leaves' list with the mean of those
    under ``min_size`` (None for the others), ``messages_R`` every replica's message
    ``(values, idx, scale)`` in replica order (None without a big leaf) and ``w_R`` their
    weights, the same on every replica."""

    def init(leaves):
        big, _ = _split_big(leaves, config.min_size)
        size = sum(leaves[i].size for i in big)
        return jnp.zeros(dct.padded(size, config.chunk), jnp.float32) if big else ()

    def sent(delta, w, finite, momentum):
        big, small = _split_big(delta, config.min_size)
        out, messages_R = list(delta), None
        if small:
            sent = _concat(_weighted(delta, w), small)
            total, _ = compress.compressed_sum(sent, axis_name, compress.FLOAT32)
            _scatter(out, delta, small, total)
        if big:
            flat = _concat(delta, big)
            flat = jnp.pad(flat, (0, momentum.shape[0] - flat.shape[0]))
            update = config.beta * momentum + jnp.where(w > 0, w * flat, 0.0)
            message, kept = dct.extract(update, config)
            # a replica left out sends zeros and keeps its momentum (dropped if non-finite)
            values, idx, scale = message  # zero values and scale: a 2-bit code 0 is -scale
            message = (jnp.where(w > 0, values, 0), idx, jnp.where(w > 0, scale, 0.0))
            momentum = jnp.where(w > 0, kept, jnp.where(finite, momentum, 0.0))
            messages_R = compress.gather_in_order(message, axis_name)
        w_R = compress.gather_in_order(w, axis_name)  # the weights too (compress.ordered_sum)
        total_w = compress.fold(lambda r, acc: acc + w_R[r], w_R.shape[0], jnp.zeros_like(w))
        return out, messages_R, w_R, momentum, total_w

    def mean(delta, w, finite, momentum, anchor=None):
        out, messages_R, _, momentum, total_w = sent(delta, w, finite, momentum)
        if messages_R is not None:
            big, _ = _split_big(delta, config.min_size)
            _scatter(out, delta, big, dct.decode_sum(messages_R, config))
        return _divide(out, total_w), momentum, total_w

    def messages(delta, w, finite, momentum):
        out, messages_R, w_R, momentum, total_w = sent(delta, w, finite, momentum)
        big, _ = _split_big(delta, config.min_size)
        small = [None if i in big else x for i, x in enumerate(_divide(out, total_w))]
        return small, messages_R, w_R, momentum, total_w

    return Exchange(init, mean, messages=messages)


def dct_mean(messages_R, w_R: jax.Array, config: dct.DctConfig) -> jax.Array:
    """The flat float32 mean that :func:`dct_momentum` decodes from ``R`` replicas' messages
    (each leaf ``[R, ...]``) and weights ``w_R``: ``decode_sum(messages) / sum_r w_r``, the
    weights added in replica order, as a sync's exchange does (a syncer decodes a learner's
    push with it)."""
    total_w = compress.fold(lambda r, acc: acc + w_R[r], w_R.shape[0], jnp.zeros([], jnp.float32))
    return _divide([dct.decode_sum(messages_R, config)], total_w)[0]
