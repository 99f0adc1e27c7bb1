"""Byte-level LM, 1.01 B parameters (d_model 2048, 20 layers, 16 heads):
one large GPU (or a host) per replica; bf16 compute, rematerialised blocks.
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
            d_model=2048,
            num_layers=20,
            num_heads=16,
            mlp_ratio=4,
            compute_dtype="bfloat16",
            remat=True,
        ),
        data=DataConfig(seq_len=1024, batch_size=16),
        inner=InnerConfig(learning_rate=3e-4, warmup_steps=100),
        outer=OuterConfig(sync_every=100),
        parallel=ParallelConfig(replicas=4),
        train=TrainConfig(total_steps=5000, log_every=50, eval_every=500),
    )
