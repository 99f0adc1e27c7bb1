"""Writes scikit-learn's 8x8 digits as PNG files, one folder per class (``OUT/0/*.png`` ...
``OUT/9/*.png``): a small image folder to try ``python -m diloco_jax.data.prepare --images``
on, with nothing to download.

    uv run python scripts/digits_folder.py OUT
"""

import pathlib
import sys

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def main(out: str) -> None:
    digits = load_digits()
    root = pathlib.Path(out)
    for i, (pixels_8x8, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        # 0..16 -> 0..255 (rounded): the pixels a camera-made dataset would hold
        Image.fromarray(np.round(pixels_8x8 * 255 / 16).astype(np.uint8)).save(folder / f"{i}.png")
    print(f"wrote {len(digits.target)} PNG files in 10 class folders under {root}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
