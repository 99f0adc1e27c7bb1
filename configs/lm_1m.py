"""Byte-level LM, 1.09 M parameters (d_model 128, 5 layers, 4 heads):
trains on a laptop CPU.
"""

from diloco_jax.config import (
    Config,
    DataConfig,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    ParallelConfig,
    TrainConfig,
)


def get_config() -> Config:
    return Config(
        model=ModelConfig(d_model=128, num_layers=5, num_heads=4, mlp_ratio=4),
        data=DataConfig(seq_len=256, batch_size=32),
        inner=InnerConfig(learning_rate=3e-3, warmup_steps=100),
        outer=OuterConfig(sync_every=100),
        parallel=ParallelConfig(replicas=4),
        train=TrainConfig(total_steps=5000, log_every=50, eval_every=500),
    )
