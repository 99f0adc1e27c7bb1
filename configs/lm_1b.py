"""Byte-level LM, 1.01 B parameters (d_model 2048, 20 layers, 16 heads):
one large GPU (or a host) per replica; bf16 compute, rematerialised blocks.
"""

import dataclasses
import pathlib

from diloco_jax.config import Config, load_preset


def get_config() -> Config:
    base = load_preset(pathlib.Path(__file__).with_name("lm_1m.py"))  # the shared settings
    return dataclasses.replace(
        base,
        model=dataclasses.replace(
            base.model,
            d_model=2048,
            num_layers=20,
            num_heads=16,
            compute_dtype="bfloat16",
            remat=True,
        ),
        data=dataclasses.replace(base.data, seq_len=1024, batch_size=16),
        inner=dataclasses.replace(base.inner, learning_rate=3e-4),
    )
