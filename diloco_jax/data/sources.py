"""Where a run's data comes from: the shipped corpus or digits, a text file (memory-mapped over
the budget), or a prepared TFDS dataset. Each source's own module reads it; this one picks the
module, so the readers never import each other."""

from __future__ import annotations

import pathlib

import numpy as np

from diloco_jax.data import corpus, stream, tfds_images, tfds_io, tfds_text
from diloco_jax.data.corpus import Corpus, DataError
from diloco_jax.data.images import IMAGE_DATASETS, Images, load_digits


def load_corpus(
    name_or_path: str, *, val_fraction: float, data_dir: str = "", max_bytes: int = 0,
    **tfds_options,
) -> Corpus:  # fmt: skip
    """Loads ``name_or_path``: ``"shakespeare"`` or a .txt/.txt.gz/.txt.xz file as byte tokens
    (the last ``val_fraction`` is the validation split), or ``tfds:NAME``, a TFDS dataset in
    array_record format under ``data_dir`` (:func:`diloco_jax.data.tfds_text.load`, whose
    keywords ``tfds_options`` are: its own splits and tokenizer).

    ``max_bytes`` (0: no limit): a text file larger than this is memory-mapped, not read
    (:func:`diloco_jax.data.stream.map_text`; ``train_N`` is then a ``np.memmap`` view), a TFDS
    training split streams from a token file (:func:`diloco_jax.data.tfds_text.stream_tokens`);
    a compressed file that would exceed it is a DataError."""
    if name_or_path.startswith("tfds:"):
        return tfds_text.load(name_or_path, data_dir, max_bytes=max_bytes, **tfds_options)
    path = corpus.SHIPPED.get(name_or_path, pathlib.Path(name_or_path).expanduser())
    if max_bytes and path.is_file() and path.stat().st_size > max_bytes:
        tokens = stream.map_text(path)
    else:
        tokens = np.frombuffer(corpus.read_bytes(path), dtype=np.uint8)
        corpus.check_budget(tokens.nbytes, max_bytes, path, "a compressed file")
    num_val = int(round(len(tokens) * val_fraction))
    if len(tokens) < 2 or num_val < 2 or len(tokens) - num_val < 2:
        raise DataError(
            f"data file {path} has {len(tokens)} bytes: too small to split with "
            f"val_fraction={val_fraction}"
        )
    return Corpus(tokens[:-num_val], tokens[-num_val:], str(path))


def is_image_data(cfg_data) -> bool:
    """True when a config's ``data`` section names image data: a shipped image dataset, or a
    TFDS dataset with an image feature."""
    corpus = cfg_data.corpus
    if corpus in IMAGE_DATASETS:
        return True
    tfds = corpus.startswith(tfds_io.TFDS_PREFIX)
    return tfds and tfds_images.is_image_dataset(corpus, cfg_data.data_dir)


def load_images(name: str, *, val_fraction: float, data_dir: str = "", **tfds_options) -> Images:
    """``digits`` (split by ``val_fraction``) or ``tfds:NAME`` (its own splits; ``tfds_options``
    are the keywords of :func:`diloco_jax.data.tfds_images.load`)."""
    if name.startswith(tfds_io.TFDS_PREFIX):
        return tfds_images.load(name, data_dir, **tfds_options)
    if name != "digits":
        raise DataError(f"image dataset {name!r} is not one of {IMAGE_DATASETS} or tfds:NAME")
    pixels_Nx8x8, labels_N = load_digits()
    order = np.random.default_rng(0).permutation(len(labels_N))
    images = (pixels_Nx8x8[order] / 16.0).astype(np.float32)[..., None]
    labels = labels_N[order].astype(np.int32)
    cut = len(labels) - int(round(len(labels) * val_fraction))
    return Images(images[:cut], labels[:cut], images[cut:], labels[cut:], 10)
