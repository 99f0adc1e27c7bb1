"""Image classification: a small ResNet (2 stages of 16 and 32 channels, 19.8 k parameters) on
the 8x8 digits (shipped with the package: diloco_jax/data/digits.npz), 4 DiLoCo replicas;
a minute on a CPU."""

from diloco_jax.config import (
    Config,
    DataConfig,
    InnerConfig,
    OuterConfig,
    ParallelConfig,
    ResNetConfig,
    TrainConfig,
)


def get_config() -> Config:
    return Config(
        resnet=ResNetConfig(width=16, stages=2, depth=1),
        data=DataConfig(corpus="digits", batch_size=32, val_fraction=0.2),
        inner=InnerConfig(learning_rate=3e-3, warmup_steps=20, weight_decay=1e-4),
        outer=OuterConfig(sync_every=20),
        parallel=ParallelConfig(replicas=4),
        train=TrainConfig(total_steps=200, log_every=20, eval_every=40, sample_chars=0),
    )
