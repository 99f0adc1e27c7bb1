"""Image-classification datasets in TFDS's array_record format, read without TensorFlow.

:func:`load` reads any TFDS dataset prepared in array_record format whose records hold an image
feature (``tfds.features.Image``, e.g. ``tfds build mnist --file_format array_record``) and an
integer or ``ClassLabel`` label: the encoded images are decoded with Pillow (TensorFlow is never
imported), optionally resized to ``image_size`` x ``image_size``, and kept as uint8 in memory
(or, over a memory budget, in a uint8 image file on disk: :func:`stream_split`).
The training split is shuffled once with a fixed seed, so contiguous per-replica shards are
i.i.d. whatever order the records were written in.

:func:`prepare` turns a folder of images, one subfolder per class (``DIR/CLASS/*.png``; or
``DIR/train/CLASS/...`` with ``DIR/validation/CLASS/...``, ``DIR/val/...`` or ``DIR/test/...``),
into such a dataset: PNG-encoded images and a ``ClassLabel`` named after the folders.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib

import numpy as np

from diloco_jax.base import extras
from diloco_jax.base.progress import progress_bar
from diloco_jax.data import tfds_io
from diloco_jax.data.corpus import DataError
from diloco_jax.data.images import Images

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
_MODES = {1: "L", 3: "RGB"}  # channels -> Pillow mode


def is_image_dataset(spec: str, data_dir: str = "") -> bool:
    """True when ``tfds:NAME`` exists and has an image feature (whatever its name: a wrong
    ``data.image_feature`` is then reported by :func:`load`)."""
    tfds = extras.require("tensorflow_datasets", f"reading {spec}")
    try:
        features = tfds_io.open_builder(spec, data_dir)[2].info.features
    except DataError:
        return False  # the text loader reports it
    return any(isinstance(features[k], tfds.features.Image) for k in features.keys())


def _normalized(image, channels: int, size: int):
    """A Pillow image in the mode of ``channels``, resized to ``size`` x ``size`` if ``size``."""
    extras.require("PIL", "converting images")
    from PIL import Image

    if image.mode.startswith("I"):  # 16-bit grayscale (I;16, I;16B, I): keep the top 8 bits
        pixels = np.asarray(image, dtype=np.int64).clip(0, 65535) >> 8
        image = Image.fromarray(pixels.astype(np.uint8))
    image = image.convert(_MODES[channels])
    return image.resize((size, size), Image.Resampling.BILINEAR) if size else image


def _decode(encoded: bytes, channels: int, size: int, where: str) -> np.ndarray:
    extras.require("PIL", "decoding images")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(encoded)) as image:
            pixels = np.asarray(_normalized(image, channels, size), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"cannot decode the image of {where}: {e}") from None
    return pixels.reshape(*pixels.shape[:2], channels)


def _decoded(source, order, split: str, spec, *, image_feature, label_feature, channels, size,
             chunk: int = 1024):  # fmt: skip
    """Yields ``(start, images_Kx..., labels_K)``: the records ``order`` names, in that order,
    decoded ``chunk`` at a time (a progress bar on large splits); one size for every image."""

    n, first = len(order), None
    bar = progress_bar(total=n, desc=f"decoding {spec} {split}", unit="image",
                       enabled=n >= 10_000)  # small splits decode in a blink  # fmt: skip
    with bar:
        for start in range(0, n, chunk):
            ids = [int(i) for i in order[start : start + chunk]]
            images, labels = [], np.zeros(len(ids), np.int64)
            for k, (i, record) in enumerate(zip(ids, source.__getitems__(ids), strict=True)):
                try:
                    labels[k] = int(np.asarray(record[label_feature]))
                except (TypeError, ValueError):
                    raise DataError(f"{spec} {split}[{i}]: label {label_feature!r} is not one "
                                    f"integer: {record[label_feature]!r}") from None  # fmt: skip
                images.append(_decode(record[image_feature], channels, size, f"{split}[{i}]"))
            shapes = {im.shape for im in images} | ({first} if first else set())
            if len(shapes) > 1:
                a, b = sorted(shapes)[:2]
                raise DataError(f"the images of {spec} {split} have different sizes ({a}, {b}, "
                                f"...): set data.image_size to resize them all to one square "
                                f"size")  # fmt: skip
            first = images[0].shape
            yield start, np.stack(images), labels
            bar.update(len(ids))


def _read_split(source, split: str, spec, **read):
    """A split's ``(images, labels)`` in its records' order, in memory."""
    parts = list(_decoded(source, np.arange(len(source)), split, spec, **read))
    return np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])


def stream_split(splits: tfds_io.Splits, split: str, spec, order, **read):
    """The training split's ``(images, labels)`` in the order ``order``: the images as a
    read-only uint8 memory map of a file written once next to the dataset
    (``DATA_DIR/NAME/_images-SPLIT.npy``, its labels in ``_labels-SPLIT.npy`` and a ``.json`` of
    what both were written from: a changed dataset, feature, size or order rewrites them).
    Decoded a chunk at a time, so memory holds one chunk of images; written under temporary
    names, then renamed (the ``.json`` last): a crash leaves no half file in use."""
    images_path = tfds_io.cache_path(splits, "images", split, ".npy")
    labels_path = tfds_io.cache_path(splits, "labels", split, ".npy")
    meta = images_path.with_suffix(".json")
    key = {"split": split, "records": len(order), "order": hashlib.sha256(order).hexdigest(),
           **read, "files": tfds_io.source_files(splits)}  # fmt: skip
    if meta.is_file() and json.loads(meta.read_text()) == key:
        return np.load(images_path, mmap_mode="r"), np.load(labels_path)
    partial = images_path.with_suffix(".partial")
    try:
        meta.unlink(missing_ok=True)
        out, labels = None, np.zeros(len(order), np.int64)
        for start, images, part in _decoded(splits.train, order, split, spec, **read):
            if out is None:
                out = np.lib.format.open_memmap(partial, "w+", np.uint8,
                                                (len(order), *images.shape[1:]))  # fmt: skip
            out[start : start + len(part)] = images
            labels[start : start + len(part)] = part
        assert out is not None  # the split has images (checked when it was opened)
        out.flush()
        del out
        with open(labels_path.with_suffix(".partial"), "wb") as f:
            np.save(f, labels)
        os.replace(labels_path.with_suffix(".partial"), labels_path)
        os.replace(partial, images_path)
        meta.write_text(json.dumps(key))
    except OSError as e:
        why = f"{e} (make the data dir writable, or raise data.max_memory_mib)"
        raise DataError(f"cannot write the image file {images_path} for streaming: {why}") from None
    return np.load(images_path, mmap_mode="r"), labels


def load(
    spec: str,
    data_dir: str = "",
    *,
    image_feature: str = "image",
    label_feature: str = "label",
    image_size: int = 0,
    train_split: str = "train",
    eval_split: str = "",
    max_bytes: int = 0,
):
    """Reads ``tfds:NAME``'s train and validation (or test) splits into
    :class:`~diloco_jax.data.images.Images` (uint8 ``[N, H, W, C]``; ``image_size`` > 0 resizes
    to ``image_size`` x ``image_size``). ``max_bytes`` (0: no limit): training images that take
    more stay on disk (:func:`stream_split`; ``train_images`` is then a ``np.memmap``)."""

    tfds = extras.require("tensorflow_datasets", f"reading {spec}")
    extras.require("PIL", f"decoding the images of {spec}")

    decoders = {image_feature: tfds.decode.SkipDecoding()}
    splits = tfds_io.open_splits(spec, data_dir, train_split=train_split, eval_split=eval_split,
                                 decoders=decoders)  # fmt: skip
    names = sorted(splits.features.keys())
    for key, name in (("data.image_feature", image_feature), ("data.label_feature", label_feature)):
        if name not in names:
            raise DataError(f"TFDS dataset {splits.name!r} has no feature {name!r} for {key} "
                            f"(features: {names})")  # fmt: skip
    feature = splits.features[image_feature]
    if not isinstance(feature, tfds.features.Image):
        raise DataError(f"{spec}: feature {image_feature!r} (data.image_feature) is not an image")
    if feature.np_dtype != np.uint8:
        raise DataError(f"{spec}: {image_feature!r} holds {feature.np_dtype} images; only uint8 "
                        f"images are supported")  # fmt: skip
    channels = feature.shape[-1] or 3
    if channels not in _MODES:
        raise DataError(f"{spec}: images with {channels} channels are not supported (1 or 3)")
    read = dict(image_feature=image_feature, label_feature=label_feature, channels=channels,
                size=image_size)  # fmt: skip
    order = np.random.default_rng(0).permutation(len(splits.train))  # i.i.d. contiguous shards
    if max_bytes:
        train_images, train_labels = stream_split(splits, train_split, spec, order, **read)
        if train_images.nbytes <= max_bytes:
            train_images = np.array(train_images)  # fits: in memory, as without a budget
    else:
        train_images, train_labels = _read_split(splits.train, train_split, spec, **read)
        train_images, train_labels = train_images[order], train_labels[order]
    val_images, val_labels = _read_split(splits.val, splits.val_split, spec, **read)
    if train_images.shape[1:] != val_images.shape[1:]:
        raise DataError(f"{spec}: training images are {train_images.shape[1:]} but validation "
                        f"images are {val_images.shape[1:]}; set data.image_size")  # fmt: skip
    num_classes = getattr(splits.features[label_feature], "num_classes", None) or 1 + int(
        max(train_labels.max(), val_labels.max())
    )
    for split, labels in ((train_split, train_labels), (splits.val_split, val_labels)):
        if labels.min() < 0 or labels.max() >= num_classes:
            raise DataError(f"{spec} {split}: labels must lie in [0, {num_classes}), found "
                            f"[{labels.min()}, {labels.max()}]")  # fmt: skip
    return Images(train_images, train_labels.astype(np.int32), val_images,
                  val_labels.astype(np.int32), num_classes)  # fmt: skip


def _class_folders(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _image_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
    )


def _folder_splits(image_dir: pathlib.Path, val_fraction: float):
    """``(classes, {split: [(path, label), ...]})`` of an image folder."""
    if not image_dir.is_dir():
        raise DataError(f"image folder not found: {image_dir}")
    top = {p.name: p for p in _class_folders(image_dir)}
    val_name = next((n for n in ("validation", "val", "test") if n in top), None)
    if "train" in top and not val_name:
        raise DataError(f"{image_dir} has a train folder but no validation, val or test folder "
                        f"beside it (or use class folders directly)")  # fmt: skip
    if "train" in top and val_name:  # predefined splits
        classes = [p.name for p in _class_folders(top["train"])]
        splits = {}
        for split, name in (("train", "train"), ("validation", val_name)):
            splits[split] = [(f, classes.index(c.name)) for c in _class_folders(top[name])
                             if c.name in classes for f in _image_files(c)]  # fmt: skip
            unknown = {c.name for c in _class_folders(top[name])} - set(classes)
            if unknown:
                raise DataError(f"{top[name]} has classes that train does not: {sorted(unknown)}")
        return classes, splits
    classes = list(top)
    if len(classes) < 2:
        raise DataError(f"{image_dir} must hold one subfolder of images per class (at least 2); "
                        f"found {classes}")  # fmt: skip
    rng = np.random.default_rng(0)
    splits = {"train": [], "validation": []}
    for label, name in enumerate(classes):  # per class, so both splits hold every class
        files = _image_files(top[name])
        files = [files[i] for i in rng.permutation(len(files))]
        held_out = max(1, int(round(len(files) * val_fraction))) if len(files) > 1 else 0
        cut = len(files) - held_out
        splits["train"] += [(f, label) for f in files[:cut]]
        splits["validation"] += [(f, label) for f in files[cut:]]
    return classes, splits


def prepare(
    image_dir: str | pathlib.Path,
    data_dir: str | pathlib.Path,
    *,
    name: str = "images",
    val_fraction: float = 0.1,
    size: int = 0,
    grayscale: bool | None = None,
) -> pathlib.Path:
    """Writes the TFDS dataset ``name`` (features ``image``: PNG, ``label``: ClassLabel named
    after the class folders) into ``data_dir``; returns its directory. Without predefined splits
    the last ``val_fraction`` of each class (at least one image of a class that has two; after a
    fixed-seed shuffle) is the validation split.
    ``size`` > 0 resizes every image to ``size`` x ``size``; otherwise all must share one size.
    ``grayscale`` None: one channel when every image is grayscale, else RGB."""
    tfds_io.check_name(name)
    if not 0 < val_fraction < 1 or size < 0:
        raise DataError(f"val_fraction {val_fraction} must be in (0, 1) and size {size} >= 0")
    extras.check("preparing an image folder", "tensorflow_datasets", "PIL")
    from PIL import Image, UnidentifiedImageError

    classes, splits = _folder_splits(pathlib.Path(image_dir).expanduser(), val_fraction)
    for split, items in splits.items():
        if not items:
            raise DataError(f"{image_dir}: the {split} split has no images "
                            f"({', '.join(IMAGE_SUFFIXES)})")  # fmt: skip
    shapes, modes = set(), set()
    for path, _ in (item for items in splits.values() for item in items):  # check, then write
        try:
            with Image.open(path) as image:
                shapes.add(image.size)
                modes.add(image.mode)
        except (UnidentifiedImageError, OSError) as e:
            raise DataError(f"cannot read image {path}: {e}") from None
    if not size and len(shapes) > 1:
        a, b = sorted(shapes)[:2]
        raise DataError(f"images in {image_dir} have different sizes ({a}, {b}, ...): pass "
                        f"--size to resize them all to one square size")  # fmt: skip
    if grayscale is None:
        grayscale = modes <= {"1", "L", "I;16", "I"}
    channels = 1 if grayscale else 3
    width, height = (size, size) if size else shapes.pop()

    def features():
        tfds = extras.require("tensorflow_datasets", "preparing an image folder")
        return tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(height, width, channels)),
            "label": tfds.features.ClassLabel(names=classes),
        })  # fmt: skip

    def records(items):
        def generate():
            for i, (path, label) in enumerate(items):
                with Image.open(path) as image:
                    png = io.BytesIO()
                    _normalized(image, channels, size).save(png, format="PNG")
                yield i, {"image": png.getvalue(), "label": label}

        return generate

    return tfds_io.write(name, data_dir, features,
                         {split: records(items) for split, items in splits.items()},
                         description=f"{len(classes)} classes from {image_dir}")  # fmt: skip
