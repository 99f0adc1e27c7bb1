"""Byte-level LM, 10.9 M parameters (d_model 384, 6 layers, 6 heads):
a small GPU or a patient CPU.
"""

import dataclasses
import pathlib

from diloco_jax.config import Config, load_preset


def get_config() -> Config:
    base = load_preset(pathlib.Path(__file__).with_name("lm_1m.py"))  # the shared settings
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, d_model=384, num_layers=6, num_heads=6),
        data=dataclasses.replace(base.data, seq_len=256, batch_size=32),
        inner=dataclasses.replace(base.inner, learning_rate=1e-3),
    )
