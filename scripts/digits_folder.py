"""Writes the shipped 8x8 digits (``diloco_jax/data/digits.npz``) as PNG files, one folder per
class (``OUT/0/*.png`` ... ``OUT/9/*.png``): a small image folder to try
``python -m diloco_jax.data.prepare --images`` on, with nothing to download. Needs Pillow (the
``images`` extra).

    uv run python scripts/digits_folder.py OUT
"""

import pathlib
import sys

import numpy as np

from diloco_jax.base import extras
from diloco_jax.data.images import load_digits


def main(out: str) -> None:
    Image = extras.require("PIL.Image", "scripts/digits_folder.py")
    images_Nx8x8, labels_N = load_digits()
    root = pathlib.Path(out)
    for i, (pixels_8x8, label) in enumerate(zip(images_Nx8x8, labels_N, strict=True)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        # 0..16 -> 0..255 (rounded): the pixels a camera-made dataset would hold
        scaled = np.round(pixels_8x8.astype(np.float64) * 255 / 16).astype(np.uint8)
        Image.fromarray(scaled).save(folder / f"{i}.png")
    print(f"wrote {len(labels_N)} PNG files in 10 class folders under {root}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        main(sys.argv[1])
    except extras.MissingExtra as e:
        sys.exit(f"error: {e}")
