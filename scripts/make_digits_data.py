"""One-off: writes ``diloco_jax/data/digits.npz``, the 8x8 digits the ``digits`` dataset trains on,
from scikit-learn's copy, so that diloco-jax ships them without depending on scikit-learn.

    uv run --with scikit-learn python scripts/make_digits_data.py

It needs scikit-learn (not a dependency of diloco-jax). The file holds ``images`` (uint8
``[1797, 8, 8]``, values 0..16) and ``labels`` (uint8 ``[1797]``, 0..9) in scikit-learn's order,
and prints their SHA-256 (``tests/test_vision.py`` checks it). Origin and licence:
``diloco_jax/data/NOTICE.md``.
"""

import hashlib
import pathlib

import numpy as np
from sklearn.datasets import load_digits

OUT = pathlib.Path(__file__).resolve().parents[1] / "diloco_jax" / "data" / "digits.npz"


def main() -> None:
    digits = load_digits()
    images = digits.images.astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    # scikit-learn stores whole numbers 0..16 as float64: uint8 holds them exactly
    assert np.array_equal(images, digits.images) and np.array_equal(labels, digits.target)
    np.savez_compressed(OUT, images=images, labels=labels)
    digest = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes): {images.shape} images, sha256 {digest}")


if __name__ == "__main__":
    main()
