"""diloco-jax: DiLoCo (Douillard et al., 2023, arXiv 2311.08105) in JAX/Flax.

``diloco(inner, outer, sync_every=..., axis_name="replica")`` is an optax transform written for
one replica; ``diloco_jax.parallel`` runs it over replicas with ``vmap`` (simulator) or
``shard_map`` (mesh); ``python -m diloco_jax.train`` trains a Transformer LM with it.
"""

from diloco_jax.compress import Codec
from diloco_jax.dct import DctConfig
from diloco_jax.diloco import (
    DilocoState,
    EagerDilocoState,
    Streaming,
    SyncStats,
    apply_updates,
    data_parallel,
    find_anchor,
    replica_axes,
    replica_mean,
)
from diloco_jax.diloco import diloco as diloco  # the function shadows its module's name
from diloco_jax.optim import inner_adamw, make_tx, outer_nesterov

__all__ = [
    "Codec",
    "DctConfig",
    "DilocoState",
    "EagerDilocoState",
    "Streaming",
    "SyncStats",
    "apply_updates",
    "data_parallel",
    "diloco",
    "find_anchor",
    "inner_adamw",
    "make_tx",
    "outer_nesterov",
    "replica_axes",
    "replica_mean",
]
