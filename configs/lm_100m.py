"""Byte-level LM, 99.8 M parameters (d_model 768, 14 layers, 12 heads):
one GPU per replica; bf16 compute.
"""

import dataclasses
import pathlib

from diloco_jax.config import Config, load_preset


def get_config() -> Config:
    base = load_preset(pathlib.Path(__file__).with_name("lm_1m.py"))  # the shared settings
    return dataclasses.replace(
        base,
        model=dataclasses.replace(
            base.model, d_model=768, num_layers=14, num_heads=12, compute_dtype="bfloat16"
        ),
        data=dataclasses.replace(base.data, seq_len=512, batch_size=32),
        inner=dataclasses.replace(base.inner, learning_rate=6e-4),
    )
