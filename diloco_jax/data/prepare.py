"""``python -m diloco_jax.data.prepare``: local text files -> a TFDS dataset (array_record).

    python -m diloco_jax.data.prepare --text FILE [FILE ...] --out DATA_DIR [--name NAME]
        [--val_fraction 0.05] [--tokenizer byte|sentencepiece] [--vocab_size 1024]
        [--record_tokens 4096]

Then train on it with ``--config.data.corpus=tfds:NAME --config.data.data_dir=DATA_DIR``.
Nothing is downloaded; TensorFlow is not needed.
"""

from __future__ import annotations

import argparse
import sys

from diloco_jax.data.corpus import DataError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco_jax.data.prepare",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--text", nargs="+", required=True, help="UTF-8 text files")
    parser.add_argument("--out", required=True, help="TFDS data dir to write into")
    parser.add_argument("--name", default="text", help="dataset name (snake_case)")
    parser.add_argument("--val_fraction", type=float, default=0.05)
    parser.add_argument("--tokenizer", default="byte", choices=("byte", "sentencepiece"))
    parser.add_argument("--vocab_size", type=int, default=1024, help="sentencepiece only")
    parser.add_argument("--record_tokens", type=int, default=4096, help="tokens per record")
    args = parser.parse_args(argv)
    from diloco_jax.data import tfds_text

    try:
        root = tfds_text.prepare(
            args.text, args.out, name=args.name, val_fraction=args.val_fraction,
            tokenizer=args.tokenizer, vocab_size=args.vocab_size,
            record_tokens=args.record_tokens,
        )  # fmt: skip
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    corpus = tfds_text.load(f"tfds:{args.name}", args.out)
    print(f"prepared {root}: {len(corpus.train_N):,} training and {len(corpus.val_M):,} "
          f"validation tokens ({corpus.source}, vocabulary {corpus.vocab_size}); train with "
          f"--config.data.corpus=tfds:{args.name} --config.data.data_dir={args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
