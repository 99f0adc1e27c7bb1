"""Text datasets in TFDS's array_record format: prepared from local files, read without
TensorFlow through ``tfds.data_source`` and ``grain``.

:func:`prepare` turns text files into a TFDS dataset ``NAME`` (splits ``train`` and
``validation``) under a data dir: the text is tokenized (bytes, or a SentencePiece model trained
on the training text and saved as ``DATA_DIR/NAME/tokenizer.model``), cut into records of
``record_tokens`` tokens, each with its position (``index``), and written by a TFDS builder.

:func:`load` reads a prepared dataset, or any TFDS dataset prepared in array_record format whose
records hold a text feature, into a :class:`~diloco_jax.data.corpus.Corpus`: every record of a
split, in ``index`` order when present, concatenated into one token stream (text records joined
by a newline), so sequences are packed across record boundaries. Sharding, batch sampling and
evaluation then work as for the shipped corpus.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

import numpy as np

from diloco_jax.base import extras
from diloco_jax.data import tfds_io
from diloco_jax.data.corpus import Corpus, DataError
from diloco_jax.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, train_sentencepiece

TOKENIZER_FILE = "tokenizer.model"


def _read_texts(paths: list[pathlib.Path]) -> str:
    parts = []
    for path in paths:
        try:
            parts.append(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataError(f"text file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"cannot read text file {path} as UTF-8: {e}") from None
    return "\n".join(parts)


def prepare(
    texts: list[str | pathlib.Path],
    data_dir: str | pathlib.Path,
    *,
    name: str = "text",
    val_fraction: float = 0.05,
    tokenizer: str = "byte",
    vocab_size: int = 1024,
    record_tokens: int = 4096,
) -> pathlib.Path:
    """Writes the TFDS dataset ``name`` into ``data_dir``; returns its directory. The last
    ``val_fraction`` of the (concatenated) text is the validation split."""
    tfds_io.check_name(name)
    if tokenizer not in ("byte", "sentencepiece"):
        raise DataError(f"tokenizer {tokenizer!r} must be byte or sentencepiece")
    if not 0 < val_fraction < 1 or record_tokens < 1:
        raise DataError(f"val_fraction {val_fraction} must be in (0, 1), record_tokens >= 1")
    text = _read_texts([pathlib.Path(t) for t in texts])
    cut = len(text) - int(round(len(text) * val_fraction))
    if cut < 2 or len(text) - cut < 2:
        raise DataError(f"{len(text)} characters of text are too few to split")
    data_dir = pathlib.Path(data_dir).expanduser()
    root = data_dir / name
    if tokenizer == "sentencepiece":
        tok: ByteTokenizer | SentencePieceTokenizer = train_sentencepiece(
            text[:cut], root / TOKENIZER_FILE, vocab_size=vocab_size
        )
    else:
        (root / TOKENIZER_FILE).unlink(missing_ok=True)
        tok = ByteTokenizer()
    dtype = (
        np.uint8 if tok.vocab_size <= 256 else np.uint16 if tok.vocab_size <= 65536 else np.int32
    )
    splits = {"train": tok.encode(text[:cut]).astype(dtype),
              "validation": tok.encode(text[cut:]).astype(dtype)}  # fmt: skip

    def features():
        tfds = extras.require("tensorflow_datasets", "preparing a text dataset")
        return tfds.features.FeaturesDict({
            "tokens": tfds.features.Tensor(shape=(None,), dtype=dtype),
            "index": np.int64,
        })  # fmt: skip

    def records(tokens):
        return lambda: (
            (i, {"tokens": tokens[start : start + record_tokens], "index": i})
            for i, start in enumerate(range(0, len(tokens), record_tokens))
        )

    return tfds_io.write(name, data_dir, features,
                         {split: records(tokens) for split, tokens in splits.items()})  # fmt: skip


def tokenizer_for(name: str, data_dir: str | pathlib.Path):
    """The dataset's SentencePiece model if it has one, else bytes."""
    path = tfds_io.data_root(data_dir) / name / TOKENIZER_FILE
    return SentencePieceTokenizer(path) if path.is_file() else ByteTokenizer()


def _record_tokens(record, tokenizer, text_feature: str) -> tuple[int, np.ndarray]:
    """``(index, tokens)`` of one record: its ``tokens`` feature (and position), or its text."""
    if "tokens" in record:
        return int(record.get("index", 0)), np.asarray(record["tokens"])
    if text_feature not in record:
        raise DataError(f"records have no 'tokens' or {text_feature!r} feature "
                        f"(features: {sorted(record)}); set data.text_feature")  # fmt: skip
    value = record[text_feature]
    text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
    return 0, tokenizer.encode(text + "\n")


def _split_tokens(source, tokenizer, text_feature: str) -> np.ndarray:
    grain = extras.require("grain", "reading a TFDS text dataset")
    tokens = functools.partial(_record_tokens, tokenizer=tokenizer, text_feature=text_feature)
    pieces = list(grain.MapDataset.source(source).map(tokens))
    pieces.sort(key=lambda p: p[0])  # stable: text records keep the source's order
    return np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0, np.int32)


def _cache_key(splits: tfds_io.Splits, split: str, tokenizer, text_feature: str) -> dict:
    """What the token file of ``split`` was written from: if any of it changes, it is rewritten."""
    return {"split": split, "records": len(splits.train), "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size, "text_feature": text_feature,
            "files": tfds_io.source_files(splits)}  # fmt: skip


def stream_tokens(splits: tfds_io.Splits, split: str, tokenizer, text_feature: str) -> np.ndarray:
    """The training split's tokens as a read-only int32 memory map of a file written once next to
    the dataset (``DATA_DIR/NAME/_tokens-SPLIT.int32``, with a ``.json`` of what it was written
    from; a changed dataset or tokenizer rewrites it). Written in two passes over the records
    (their lengths, then their tokens at their offsets), so memory holds one record at a time;
    the order is :func:`load`'s. Written to a temporary name, then renamed: a crash leaves no
    half file behind."""
    path = tfds_io.cache_path(splits, "tokens", split, ".int32")
    meta, key = path.with_suffix(".json"), _cache_key(splits, split, tokenizer, text_feature)
    if path.is_file() and meta.is_file() and json.loads(meta.read_text()) == key:
        return np.memmap(path, np.int32, "r")
    source = splits.train
    lengths = []  # (index, record, length)
    for i in range(len(source)):
        index, tokens = _record_tokens(source[i], tokenizer, text_feature)
        lengths.append((index, i, len(tokens)))
    lengths.sort()  # by index, then record: the order of _split_tokens
    total = sum(n for _, _, n in lengths)
    if total == 0:  # load() names the problem
        return np.zeros(0, np.int32)
    partial = path.with_suffix(".partial")
    try:
        out = np.memmap(partial, np.int32, "w+", shape=(total,))
        start = 0
        for _, i, n in lengths:
            out[start : start + n] = _record_tokens(source[i], tokenizer, text_feature)[1]
            start += n
        out.flush()
        del out
        os.replace(partial, path)
        meta.write_text(json.dumps(key))
    except OSError as e:
        raise DataError(
            f"cannot write the token file {path} for streaming {splits.name!r}: {e} "
            "(make the data dir writable, or raise data.max_memory_mib)"
        ) from None
    return np.memmap(path, np.int32, "r", shape=(total,))


def load(
    spec: str, data_dir: str = "", *, text_feature: str = "text", train_split="train",
    eval_split="", max_bytes: int = 0,
) -> Corpus:  # fmt: skip
    """``spec`` is ``tfds:NAME``; reads ``train_split`` and ``eval_split`` (default
    ``validation``, else ``test``). ``max_bytes`` (0: no limit): a training split whose int32
    tokens take more is streamed from a token file (:func:`stream_tokens`; ``train_N`` is then
    a ``np.memmap``)."""
    splits = tfds_io.open_splits(spec, data_dir, train_split=train_split, eval_split=eval_split)
    tok = tokenizer_for(splits.name, splits.root)
    if max_bytes:
        train: np.ndarray = stream_tokens(splits, train_split, tok, text_feature)
        if train.nbytes <= max_bytes:
            train = np.array(train)  # fits: in memory, as without a budget
    else:
        train = _split_tokens(splits.train, tok, text_feature)
    val = _split_tokens(splits.val, tok, text_feature)
    if len(train) < 2 or len(val) < 2:
        raise DataError(f"TFDS dataset {splits.name!r} has too few tokens "
                        f"({len(train)}, {len(val)})")  # fmt: skip
    return Corpus(train, val, f"{splits.root / splits.name} ({tok.name} tokens)",
                  tok.vocab_size, tok)  # fmt: skip
