"""Convergence study: DiLoCo vs sync_every, single and ddp, from a warm start.

Used by ``scripts/convergence_study.sh``: a short single-worker pretraining run gives the warm
start (``train.init_from``), then every variant trains the same number of inner steps.
"""

from diloco_jax.config import (
    Config,
    DataConfig,
    InnerConfig,
    OuterConfig,
    ParallelConfig,
    SimConfig,
    TrainConfig,
)


def get_config() -> Config:
    return Config(
        data=DataConfig(seq_len=128, batch_size=16, eval_windows=256),
        inner=InnerConfig(learning_rate=2e-3, warmup_steps=20, final_lr_fraction=0.1),
        outer=OuterConfig(sync_every=50, learning_rate=0.7, momentum=0.9),
        parallel=ParallelConfig(replicas=4, runtime="sim"),
        train=TrainConfig(total_steps=400, log_every=10, eval_every=50, sample_chars=0),
        # One replica's inner step on its own device, fixed so that the simulated clock does not
        # depend on the load of the machine running the study: 0.047 s is what these runs
        # measured on the 2-core development VM (vmapped step time / 4, summary.json).
        sim=SimConfig(step_time_s=0.047),
    )
