"""Default: 4 DiLoCo replicas train a byte-level Transformer LM on Shakespeare.

About 3-4 minutes on 2 CPU cores (see README for a measured run)."""

from diloco_jax.config import Config


def get_config() -> Config:
    return Config()
