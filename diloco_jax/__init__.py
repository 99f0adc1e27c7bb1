"""diloco-jax: DiLoCo (Douillard et al., 2023, arXiv 2311.08105) in JAX/Flax.

``diloco(inner, outer, sync_every=..., axis_name="replica")`` builds the algorithm over a
replica-stacked state (``init_replicas``); its ``update`` is written for one replica and
``diloco_jax.runtime.parallel`` runs it over replicas with ``vmap`` (simulator) or
``shard_map`` (mesh); ``python -m diloco_jax.train`` trains a Transformer LM (or a ResNet) with it.
"""

from diloco_jax.algorithm import (
    PER_REPLICA,
    SHARED,
    Diloco,
    DilocoState,
    OptionError,
    Streaming,
    SyncPlan,
    check_options,
    data_parallel,
    diloco,
    init_replicas,
    single,
    vmap_axes,
)
from diloco_jax.algorithm.compress import Codec
from diloco_jax.algorithm.dct import DctConfig
from diloco_jax.algorithm.diagnostics import SyncStats
from diloco_jax.algorithm.exchange import replica_mean
from diloco_jax.algorithm.optim import inner_adamw, make_algorithm, outer_nesterov
from diloco_jax.fit import FitResult, fit, sweep
from diloco_jax.tasks import ArrayTask, GrainTask, TaskError, replica_batches

__all__ = [
    "PER_REPLICA", "SHARED", "ArrayTask", "Codec", "DctConfig", "Diloco", "DilocoState",
    "FitResult", "GrainTask", "OptionError", "Streaming", "SyncPlan", "SyncStats", "TaskError",
    "check_options", "data_parallel", "diloco", "fit", "init_replicas", "inner_adamw",
    "make_algorithm", "outer_nesterov", "replica_batches", "replica_mean", "single", "sweep",
    "vmap_axes",
]  # fmt: skip
