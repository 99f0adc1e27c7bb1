"""The run's configuration: the schema of every key (:mod:`~diloco_jax.config.schema`), the
presets that come with diloco-jax, command-line parsing, the rules every value must meet, and
the two recipes that turn a config into what the library takes: the algorithm
(:mod:`~diloco_jax.config.recipe`) and the task (:mod:`~diloco_jax.config.problems`).

The package's face is the schema, its dotted keys (:mod:`~diloco_jax.config.dotted`) and
:func:`validate`; its modules import those modules themselves, never this one, so nothing
here imports in a circle."""

from diloco_jax.base.errors import ConfigError
from diloco_jax.config.dotted import (
    Key,
    apply_overrides,
    described,
    keys,
    load_preset,
    override,
    parse_value,
    replace,
    to_dict,
)
from diloco_jax.config.schema import (
    DEFAULT_PRESET,
    RUNTIMES,
    WANDB_MODES,
    CompressConfig,
    Config,
    DataConfig,
    DeslocConfig,
    InnerConfig,
    LogConfig,
    MergeConfig,
    ModelConfig,
    NolocoConfig,
    OuterConfig,
    ParallelConfig,
    ResNetConfig,
    ServeConfig,
    SimConfig,
    StreamingConfig,
    SyncerConfig,
    TaskConfig,
    TrainConfig,
)
from diloco_jax.config.validation import removed_learners, validate

__all__ = [
    "CompressConfig",
    "Config",
    "ConfigError",
    "DEFAULT_PRESET",
    "DataConfig",
    "DeslocConfig",
    "InnerConfig",
    "Key",
    "LogConfig",
    "ModelConfig",
    "NolocoConfig",
    "OuterConfig",
    "ParallelConfig",
    "RUNTIMES",
    "ResNetConfig",
    "ServeConfig",
    "SyncerConfig",
    "SimConfig",
    "MergeConfig",
    "StreamingConfig",
    "TaskConfig",
    "TrainConfig",
    "WANDB_MODES",
    "apply_overrides",
    "described",
    "keys",
    "load_preset",
    "override",
    "parse_value",
    "removed_learners",
    "replace",
    "to_dict",
    "validate",
]
