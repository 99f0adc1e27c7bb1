"""Tokenizers: UTF-8 bytes (the default, no files) and SentencePiece trained locally.

Both map text to a 1-D integer array and back. A SentencePiece model is trained from the prepared
text by ``python -m diloco_jax.data.prepare --tokenizer sentencepiece`` and saved with the
dataset (``tokenizer.model``); it uses identity normalization and byte fallback, so any text
round-trips exactly.
"""

from __future__ import annotations

import pathlib
import tempfile

import numpy as np

from diloco_jax.base import extras

BYTE_VOCAB = 256


class ByteTokenizer:
    """UTF-8 bytes: vocabulary 256."""

    vocab_size = BYTE_VOCAB
    name = "byte"

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model read from ``path``."""

    name = "sentencepiece"

    def __init__(self, path: str | pathlib.Path):
        spm = extras.require("sentencepiece", f"the SentencePiece tokenizer {path}")
        self.path = pathlib.Path(path)
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size = int(self._sp.get_piece_size())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in np.asarray(ids)])


def train_sentencepiece(
    text: str, path: pathlib.Path, *, vocab_size: int
) -> SentencePieceTokenizer:
    """Trains a BPE SentencePiece model of at most ``vocab_size`` pieces on ``text`` and saves it
    to ``path`` (identity normalization, byte fallback: every text round-trips)."""
    spm = extras.require("sentencepiece", "training a SentencePiece tokenizer")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = pathlib.Path(tmp) / "train.txt"
        corpus.write_text(text, encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(pathlib.Path(tmp) / "sp"), model_type="bpe",
            vocab_size=vocab_size, hard_vocab_limit=False, byte_fallback=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            split_by_whitespace=True, character_coverage=1.0, bos_id=-1, eos_id=-1,
            max_sentence_length=1 << 20, minloglevel=2,
        )  # fmt: skip
        path.write_bytes((pathlib.Path(tmp) / "sp.model").read_bytes())
    return SentencePieceTokenizer(path)
