"""Reading and writing TFDS datasets in array_record format, without TensorFlow.

:func:`open_splits` opens a dataset's training and evaluation splits from its prepared
directory (``tfds.builder_from_directory``) with one clear error when the dataset, a split or
its files are missing or unreadable;
:func:`write` writes examples through an (unregistered) TFDS builder, so the result is an
ordinary TFDS dataset that ``tfds.data_source`` and ``tfds.builder_from_directory`` read.
"""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from diloco_jax.base import extras
from diloco_jax.data.corpus import DataError

TFDS_PREFIX = "tfds:"


def default_data_dir() -> pathlib.Path:
    return pathlib.Path("~/tensorflow_datasets").expanduser()


def data_root(data_dir: str | pathlib.Path | None) -> pathlib.Path:
    return pathlib.Path(data_dir or default_data_dir()).expanduser()


def check_name(name: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise DataError(f"dataset name {name!r} must be snake_case: [a-z][a-z0-9_]*")


class Splits(NamedTuple):
    name: str
    root: pathlib.Path  # the data dir
    train: Any  # a tfds ArrayRecordDataSource: len(), [i], __getitems__
    val: Any
    val_split: str  # the evaluation split's name (e.g. "validation", "test", "train[90%:]")
    features: Any  # tfds.features.FeaturesDict


def _version(path: pathlib.Path) -> tuple[int, ...] | None:
    """``(major, minor, patch)`` of a version directory like ``1.0.0``, else None."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", path.name):
        return None
    return tuple(map(int, path.name.split(".")))


def builder_dir(name: str, root: pathlib.Path) -> pathlib.Path:
    """The newest prepared version of ``NAME`` or ``NAME/CONFIG`` under ``root``: read from the
    directory, so a locally prepared dataset is found whatever TFDS has registered under its
    name (and whichever version that registration expects)."""
    prepared = [p.parent for p in (root / name).glob("*/dataset_info.json") if _version(p.parent)]
    if not prepared:  # configs: NAME/CONFIG/VERSION
        configs = sorted({p.parent.parent.name for p in (root / name).glob("*/*/dataset_info.json")
                          if _version(p.parent)})  # fmt: skip
        if len(configs) > 1:
            raise DataError(f"TFDS dataset {name!r} in {root} has configs {configs}: name one, "
                            f"as tfds:{name}/{configs[0]}")  # fmt: skip
        prepared = [p.parent for p in (root / name).glob("*/*/dataset_info.json")
                    if _version(p.parent)]  # fmt: skip
    if not prepared:
        raise DataError(f"TFDS dataset {name!r} in {root} has no prepared version (a directory "
                        f"like {root / name / '1.0.0'} with a dataset_info.json)")  # fmt: skip
    return max(prepared, key=lambda p: _version(p) or ())  # each has a version (filtered above)


def open_splits(
    spec: str, data_dir: str = "", *, train_split="train", eval_split="", decoders=None
) -> Splits:
    """Opens ``tfds:NAME`` (or ``tfds:NAME/CONFIG``) under ``data_dir`` (default
    ``~/tensorflow_datasets``): its newest prepared version's ``train_split`` and
    ``eval_split`` (default: ``validation``, else ``test``), TFDS split strings such as
    ``train[:90%]`` or ``train+validation`` included."""
    name, root, builder = open_builder(spec, data_dir)
    have = sorted(builder.info.splits)
    eval_split = eval_split or ("validation" if "validation" in have else "test")
    for key, split in (("data.train_split", train_split), ("data.eval_split", eval_split)):
        try:
            examples = builder.info.splits[split].num_examples  # slices and "a+b" too
        except Exception:  # TFDS raises KeyError or ValueError for unknown or malformed splits
            raise DataError(f"TFDS dataset {name!r} has no split {split!r} for {key} (it has "
                            f"{have}; slices such as train[:90%] also work)") from None  # fmt: skip
        if not examples:
            raise DataError(f"split {split!r} ({key}) of TFDS dataset {name!r} is empty")
    try:
        train, val = builder.as_data_source(split=[train_split, eval_split], decoders=decoders)
    except Exception as e:  # TFDS raises several types for bad slices or unreadable files
        raise DataError(f"cannot read splits {train_split!r}, {eval_split!r} of TFDS dataset "
                        f"{name!r} in {builder.data_dir}: {e}") from None  # fmt: skip
    return Splits(name, root, train, val, eval_split, builder.info.features)


def open_builder(spec: str, data_dir: str = ""):
    """``(name, data dir, builder)`` of ``tfds:NAME`` (or ``tfds:NAME/CONFIG``): its newest
    prepared version, read from its directory. Raises DataError naming how to prepare a missing
    dataset."""
    tfds = extras.require("tensorflow_datasets", f"reading {spec}")
    name = spec.removeprefix(TFDS_PREFIX)
    root = data_root(data_dir)
    if not (root / name).is_dir():
        raise DataError(
            f"TFDS dataset {name!r} not found in {root}: prepare it with `python -m "
            f"diloco_jax.data.prepare --text FILE... (or --images DIR) --out {root} --name "
            f"{name}` (or `tfds build {name} --data_dir {root} --file_format array_record` "
            f"where it can be downloaded)"
        )
    path = builder_dir(name, root)
    try:
        return name, root, tfds.builder_from_directory(path)
    except Exception as e:  # TFDS raises several types for unreadable or foreign datasets
        raise DataError(f"cannot read TFDS dataset {name!r} in {path}: {e}") from None


def write(
    name: str,
    data_dir: str | pathlib.Path,
    features: Callable[[], Any],
    splits: dict[str, Callable[[], Iterable[tuple[Any, dict]]]],
    *,
    description: str = "",
) -> pathlib.Path:
    """Writes the TFDS dataset ``name`` (version 1.0.0, array_record) into ``data_dir``: its
    features are ``features()`` (a FeaturesDict), split ``s`` holds the ``(key, example)`` pairs
    of ``splits[s]()``. Returns the dataset's directory."""
    tfds = extras.require("tensorflow_datasets", f"writing the TFDS dataset {name!r}")
    check_name(name)

    class Prepared(tfds.core.GeneratorBasedBuilder, skip_registration=True):  # type: ignore[name-defined,call-arg]  # tfds is a module found at run time
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=features(),
                                         description=description)  # fmt: skip

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(make) for split, make in splits.items()}

        def _generate_examples(self, make):
            yield from make()

    Prepared.name = name
    data_dir = pathlib.Path(data_dir).expanduser()
    again = tfds.download.DownloadConfig(  # preparing a name again replaces its records
        download_mode=tfds.download.GenerateMode.FORCE_REDOWNLOAD
    )
    Prepared(data_dir=str(data_dir), file_format="array_record").download_and_prepare(
        download_config=again
    )
    return data_dir / name


def cache_path(splits: Splits, kind: str, split: str, suffix: str) -> pathlib.Path:
    """Where a file derived from ``split`` of the dataset lives, next to the dataset:
    ``DATA_DIR/NAME/_KIND-SPLIT.SUFFIX`` (the split string made file-safe)."""
    stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", split)
    return splits.root / splits.name / f"_{kind}-{stem}{suffix}"


def source_files(splits: Splits) -> list:
    """The dataset's record files with their sizes and mtimes: a derived file written from other
    files than these is stale."""
    files = (splits.root / splits.name).rglob("*array_record*")
    return sorted([str(p.relative_to(splits.root)), p.stat().st_size, p.stat().st_mtime_ns]
                  for p in files)  # fmt: skip
