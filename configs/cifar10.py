"""Image classification on CIFAR-10 prepared locally as a TFDS dataset (array_record): a ResNet
with 3 stages of 32, 64 and 128 channels, 2 blocks each (0.70 M parameters), 4 DiLoCo replicas.

Prepare once where the dataset can be downloaded (TensorFlow is needed for that step only):
    tfds build cifar10 --file_format array_record
then copy ~/tensorflow_datasets/cifar10 to the training machines. Training reads it without
TensorFlow (--config.data.data_dir=DIR if it is not in ~/tensorflow_datasets). A GPU job: 5,000
inner steps of 4 x 128 images.
"""

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
        resnet=ResNetConfig(width=32, stages=3, depth=2),
        data=DataConfig(corpus="tfds:cifar10", batch_size=128),
        inner=InnerConfig(learning_rate=2e-3, warmup_steps=200, weight_decay=5e-4),
        outer=OuterConfig(sync_every=100),
        parallel=ParallelConfig(replicas=4),
        train=TrainConfig(total_steps=5000, log_every=100, eval_every=500, sample_chars=0),
    )
