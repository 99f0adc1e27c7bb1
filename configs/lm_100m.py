"""Byte-level LM, 99.8 M parameters (d_model 768, 14 layers, 12 heads):
one GPU per replica; bf16 compute.
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
        model=ModelConfig(
            d_model=768, num_layers=14, num_heads=12, mlp_ratio=4, compute_dtype="bfloat16"
        ),
        data=DataConfig(seq_len=512, batch_size=32),
        inner=InnerConfig(learning_rate=6e-4, warmup_steps=100),
        outer=OuterConfig(sync_every=100),
        parallel=ParallelConfig(replicas=4),
        train=TrainConfig(total_steps=5000, log_every=50, eval_every=500),
    )
