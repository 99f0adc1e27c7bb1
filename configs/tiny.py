"""Tiny: trains in seconds on a CPU. For tests, CI and trying things out."""

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
        model=ModelConfig(d_model=32, num_layers=1, num_heads=2, mlp_ratio=2),
        data=DataConfig(seq_len=32, batch_size=4, eval_windows=32),
        inner=InnerConfig(learning_rate=3e-3, warmup_steps=2),
        outer=OuterConfig(sync_every=5),
        parallel=ParallelConfig(replicas=4),
        train=TrainConfig(total_steps=20, log_every=5, eval_every=10, sample_chars=40),
    )
