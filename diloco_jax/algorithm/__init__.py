"""The algorithm: DiLoCo over a replica-stacked state and its pieces, and the baselines."""

from diloco_jax.algorithm.baselines import Local, LocalState, data_parallel, single
from diloco_jax.algorithm.build import diloco, init_replicas, maskable, vmap_axes
from diloco_jax.algorithm.core import Diloco, DilocoState
from diloco_jax.algorithm.moments import MomentSync
from diloco_jax.algorithm.options import OptionError
from diloco_jax.algorithm.plan import SyncPlan
from diloco_jax.algorithm.state import PER_REPLICA, SHARED
from diloco_jax.algorithm.timing import OUTER_MODES
from diloco_jax.algorithm.variants import Streaming, check_options

__all__ = [
    "OUTER_MODES", "PER_REPLICA", "SHARED", "Diloco", "DilocoState", "Local", "LocalState",
    "MomentSync",
    "OptionError", "Streaming", "SyncPlan", "check_options", "data_parallel", "diloco",
    "init_replicas", "maskable", "single", "vmap_axes",
]  # fmt: skip
