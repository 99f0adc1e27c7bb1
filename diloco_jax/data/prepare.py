"""``python -m diloco_jax.data.prepare``: local text files or an image folder -> a TFDS dataset
(array_record).

    python -m diloco_jax.data.prepare --text FILE [FILE ...] --out DATA_DIR [--name NAME]
        [--val_fraction 0.05] [--tokenizer byte|sentencepiece] [--vocab_size 1024]
        [--record_tokens 4096]
    python -m diloco_jax.data.prepare --images DIR --out DATA_DIR [--name NAME]
        [--val_fraction 0.1] [--size N]

An image folder holds one subfolder of images per class (``DIR/CLASS/*.png``), or predefined
splits (``DIR/train/CLASS/...`` and ``DIR/validation/CLASS/...``, ``DIR/val/...`` or
``DIR/test/...``).
Then train on it with ``--config.data.corpus=tfds:NAME --config.data.data_dir=DATA_DIR``.
Nothing is downloaded; TensorFlow is not needed.
"""

from __future__ import annotations

import math
import pathlib
import sys

from diloco_jax.base import extras
from diloco_jax.base.commandline import ArgumentParser, check_output_dir
from diloco_jax.base.errors import ConfigError
from diloco_jax.data.corpus import DataError


def _or(value, default):
    return default if value is None else value


def _prepare(args):
    """Writes the dataset; returns its directory and a line describing it."""
    if args.text:
        from diloco_jax.data import tfds_text

        root = tfds_text.prepare(
            args.text, args.out, name=args.name or "text",
            val_fraction=_or(args.val_fraction, 0.05), tokenizer=args.tokenizer,
            vocab_size=args.vocab_size, record_tokens=args.record_tokens,
        )  # fmt: skip
        corpus = tfds_text.load(f"tfds:{root.name}", args.out)
        return root, (
            f"prepared {root}: {len(corpus.train_N):,} training and {len(corpus.val_M):,} "
            f"validation tokens ({corpus.source}, vocabulary {corpus.vocab_size})"
        )
    from diloco_jax.data import tfds_images, tfds_io

    root = tfds_images.prepare(
        args.images, args.out, name=args.name or "images",
        val_fraction=_or(args.val_fraction, 0.1), size=args.size,
    )  # fmt: skip
    info = tfds_io.open_builder(f"tfds:{root.name}", args.out)[2].info  # no decoding
    return root, (
        f"prepared {root}: {info.splits['train'].num_examples:,} training and "
        f"{info.splits['validation'].num_examples:,} validation images of "
        f"{'x'.join(map(str, info.features['image'].shape))}, "
        f"{info.features['label'].num_classes} classes"
    )


def _check(args) -> None:
    """Refuses bad values and unusable paths before anything is read or written."""
    from diloco_jax.data import tfds_io

    tfds_io.check_name(args.name or ("images" if args.images else "text"))
    rules = [
        ("--val_fraction", args.val_fraction is None or 0 < args.val_fraction < 1, "in (0, 1)"),
        ("--vocab_size", args.vocab_size >= 2, ">= 2"),
        ("--record_tokens", args.record_tokens >= 1, ">= 1"),
        ("--size", args.size >= 0, ">= 0 (0: keep)"),
    ]
    for flag, ok, allowed in rules:
        value = getattr(args, flag[2:])
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            raise DataError(f"{flag} = {value!r} is invalid: must be {allowed}")
    for path in args.text or ():
        if not pathlib.Path(path).expanduser().is_file():
            raise DataError(f"--text {path}: no such file")
    if args.images and not pathlib.Path(args.images).expanduser().is_dir():
        raise DataError(f"--images {args.images}: no such folder")
    check_output_dir(args.out, "--out")
    if args.images:
        extras.check("preparing images (--images)", "tensorflow_datasets", "PIL")
    elif args.tokenizer == "sentencepiece":
        extras.check("preparing text (--text) with --tokenizer sentencepiece",
                     "tensorflow_datasets", "grain", "sentencepiece")  # fmt: skip
    else:
        extras.check("preparing text (--text)", "tensorflow_datasets", "grain")


def main(argv: list[str] | None = None, *, prog: str = "python -m diloco_jax.data.prepare") -> int:
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", nargs="+", help="UTF-8 text files")
    source.add_argument("--images", help="a folder with one subfolder of images per class")
    parser.add_argument("--out", required=True, help="TFDS data dir to write into")
    parser.add_argument("--name", default="", help="dataset name (snake_case; text / images)")
    parser.add_argument(
        "--val_fraction",
        type=float,
        default=None,
        help="validation share (text: 0.05 of the end; images: 0.1 per class)",
    )
    parser.add_argument("--tokenizer", default="byte", choices=("byte", "sentencepiece"))
    parser.add_argument("--vocab_size", type=int, default=1024, help="sentencepiece only")
    parser.add_argument("--record_tokens", type=int, default=4096, help="tokens per record")
    parser.add_argument(
        "--size",
        type=int,
        default=0,
        help="images only: resize to SIZE x SIZE (needed when sizes differ)",
    )
    args = parser.parse_args(argv)
    kind = "images" if args.images else "text"
    other = {"text": ("size",), "images": ("tokenizer", "vocab_size", "record_tokens")}[kind]
    ignored = [f"--{key}" for key in other if getattr(args, key) != parser.get_default(key)]
    if ignored:
        parser.error(f"{', '.join(ignored)} does not apply to --{kind}")
    try:
        _check(args)
        root, line = _prepare(args)
    except (DataError, ConfigError, extras.MissingExtra) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{line}; train with --config.data.corpus=tfds:{root.name} "
          f"--config.data.data_dir={args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
