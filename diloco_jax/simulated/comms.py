"""Communication accounting: exact bytes per reduce and a network model of its time.

Bytes come from each leaf's size and wire dtype. Per replica and per reduce of ``P`` bytes:

* ring all-reduce (reduce-scatter then all-gather, each ``R - 1`` steps of ``P / R``): every
  replica sends ``2 (R - 1) / R * P`` bytes (and receives as many); time
  ``2 (R - 1) * (latency + P / (R * bandwidth))``;
* parameter server: every replica sends its own ``P`` (:func:`push_payload`) and receives
  ``P``; the server's link carries ``R * P`` each way, so the time is
  ``2 * (latency + R * P / bandwidth)`` (independent learners' syncer,
  :mod:`diloco_jax.learners`, is one; its answer is the float32 anchor, whatever the codec);
* pairwise (NoLoCo's exchange with one partner): every replica sends ``P`` to its partner and
  receives as much, at once: ``latency + P / bandwidth``.

DiLoCo reduces its pseudo-gradient once per sync; ``ddp`` reduces its gradient every step;
``single`` never communicates. With a codec
(:mod:`diloco_jax.algorithm.compress`) ``P`` is the encoded size (:func:`sync_payload`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from diloco_jax.algorithm import compress, dct, fragments
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.algorithm.plan import SyncPlan

TOPOLOGIES = ("ring", "parameter_server")
PAIRWISE = "pairwise"  # NoLoCo's exchange with one partner (not a config topology)


class Network(NamedTuple):
    bandwidth_gbps: float  # per link, gigabits per second
    latency_ms: float  # per message


NETWORKS = {
    "datacenter": Network(bandwidth_gbps=100.0, latency_ms=0.01),
    "wan_1gbit": Network(bandwidth_gbps=1.0, latency_ms=50.0),
}


def payload_bytes(tree: Any, wire_dtype: Any = None) -> int:
    """Bytes of ``tree`` on the wire: sum over leaves of size x itemsize (of ``wire_dtype`` if
    given, else each leaf's own dtype)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        itemsize = np.dtype(wire_dtype or leaf.dtype).itemsize
        total += int(np.prod(np.shape(leaf))) * itemsize
    return total


def sync_payload(
    tree: Any, codec: compress.Codec | None, replicas: int, dct_config: DctConfig | None = None
) -> int:
    """``P`` of one DiLoCo sync of ``tree`` with ``codec`` among ``replicas`` members, such that
    :func:`bytes_per_replica` and :func:`reduce_seconds` give what the compressed all-reduce
    moves: leaves under ``codec.min_size`` in float32, the others concatenated, padded to a
    multiple of ``replicas * block`` and encoded (both the reduce-scatter and the all-gather
    carry encoded values). ``topk`` all-gathers ``k`` (value, position) pairs, ``(R - 1) * 8k``
    bytes per replica, written as the ``P = R * 8k / 2`` that the ring formula turns into that;
    DCT momentum (``dct_config``) likewise all-gathers each replica's message
    (:func:`diloco_jax.algorithm.dct.message_bytes`)."""
    leaves = jax.tree.leaves(tree)
    if dct_config is not None:
        small, count = _split(leaves, dct_config.min_size)
        return small + (replicas * dct.message_bytes(count, dct_config) // 2 if count else 0)
    if codec is None or codec.name == "none":
        return payload_bytes(tree)
    small, count = _split(leaves, codec.min_size)
    if count == 0:
        return small
    if codec.name == "topk":
        return small + replicas * compress.encoded_bytes(count, codec) // 2
    return small + compress.encoded_bytes(compress.padded_size(count, replicas, codec.block), codec)


def _split(leaves: list, min_size: int) -> tuple[int, int]:
    """``(float32 bytes of the leaves under min_size, values of the others)``."""
    small = sum(4 * leaf.size for leaf in leaves if leaf.size < min_size)
    return small, sum(leaf.size for leaf in leaves if leaf.size >= min_size)


def push_payload(tree: Any, codec: compress.Codec | None, replicas: int = 1,
                 dct_config: DctConfig | None = None) -> int:  # fmt: skip
    """``P`` of one member's push to a parameter server (a learner's to its syncer,
    :mod:`diloco_jax.learners.payload`): its own message, not cut into ring chunks. Leaves under
    ``codec.min_size`` in float32; the others concatenated, padded to whole blocks and encoded;
    ``topk`` sends ``k`` (value, position) pairs, ``k`` the top-k count of each of the member's
    ``replicas`` replicas together (at most every value). DCT momentum (``dct_config``): each
    of its replicas' message (:func:`diloco_jax.algorithm.dct.message_bytes`, as
    :func:`sync_payload` counts one) and its float32 weight."""
    if dct_config is not None:
        small, count = _split(jax.tree.leaves(tree), dct_config.min_size)
        return small + (replicas * (dct.message_bytes(count, dct_config) + 4) if count else 0)
    if codec is None or codec.name == "none":
        return payload_bytes(tree)
    small, count = _split(jax.tree.leaves(tree), codec.min_size)
    if count == 0:
        return small
    if codec.name == "topk":
        return small + 8 * min(count, replicas * compress.topk_count(count, codec.topk_fraction))
    return small + compress.encoded_bytes(compress.padded_size(count, 1, codec.block), codec)


def bytes_per_replica(payload: int, replicas: int, topology: str = "ring") -> float:
    """Bytes one replica sends in one reduce of ``payload`` bytes (0 for a single replica)."""
    if replicas <= 1:
        return 0.0
    if topology == "ring":
        return 2 * (replicas - 1) / replicas * payload
    if topology in ("parameter_server", PAIRWISE):
        return float(payload)
    raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")


def reduce_seconds(payload: int, replicas: int, network: Network, topology: str = "ring") -> float:
    """Time of one reduce of ``payload`` bytes over ``network`` (0 for a single replica)."""
    if replicas <= 1:
        return 0.0
    bytes_per_s = network.bandwidth_gbps * 1e9 / 8
    latency = network.latency_ms / 1e3
    if topology == "ring":
        return 2 * (replicas - 1) * (latency + payload / replicas / bytes_per_s)
    if topology == "parameter_server":
        return 2 * (latency + replicas * payload / bytes_per_s)
    if topology == PAIRWISE:  # both partners send at once over their own link
        return latency + payload / bytes_per_s
    raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")


def reduces(algorithm: str, steps: int, sync_every: int) -> int:
    """How many reduces a run of ``steps`` inner steps makes."""
    return {"diloco": steps // sync_every, "ddp": steps, "single": 0}[algorithm]


def sync_payloads(
    tree: Any,
    codec: compress.Codec | None,
    replicas: int,
    *,
    dct_config: DctConfig | None = None,
    num_fragments: int = 1,
    payload=None,
) -> list[int]:
    """``P`` of each fragment's sync (one entry without streaming), fragments as
    :func:`diloco_jax.algorithm.fragments.strided` assigns them; ``payload(leaves, codec,
    replicas)`` (:func:`push_payload`), or :func:`sync_payload` by default."""
    leaves = jax.tree.leaves(tree)
    groups = fragments.groups(fragments.strided(tree, num_fragments), num_fragments)
    if payload is not None:
        return [payload([leaves[i] for i in idx], codec, replicas) for idx in groups]
    return [sync_payload([leaves[i] for i in idx], codec, replicas, dct_config) for idx in groups]


def diloco_sync_events(steps: int, sync_every: int, num_fragments: int = 1) -> list[int]:
    """The fragment of every sync a DiLoCo run of ``steps`` inner steps makes, in order."""
    return [f for _, f in SyncPlan(sync_every, num_fragments).sync_steps(1, steps)]
