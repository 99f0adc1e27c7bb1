"""TFDS text datasets prepared from local files (array_record, no TensorFlow), read back exactly,
trained on, sharded and resumed; SentencePiece; clear errors."""

import lzma
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from diloco_jax.config import apply_overrides, load_preset
from diloco_jax.data import DataError, load_corpus, replica_shards, tfds_text
from diloco_jax.data.tokenizer import SentencePieceTokenizer
from diloco_jax.train import train

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    with lzma.open(ROOT / "diloco_jax/data/shakespeare.txt.xz", "rt", encoding="utf-8") as f:
        text = f.read(60_000) + "é — ünïcode ✓\n"  # and a few multi-byte characters
    path = tmp_path_factory.mktemp("text") / "plays.txt"
    path.write_text(text, encoding="utf-8")
    return path, text


@pytest.fixture(scope="module")
def data_dir(text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("tfds")
    path, _ = text_file
    tfds_text.prepare([path], out, name="plays", val_fraction=0.1, record_tokens=1000)
    tfds_text.prepare([path], out, name="plays_sp", val_fraction=0.1, tokenizer="sentencepiece",
                      vocab_size=400, record_tokens=1000)  # fmt: skip
    return out


def test_prepared_dataset_reads_back_as_the_exact_text(text_file, data_dir):
    _, text = text_file
    corpus = load_corpus("tfds:plays", val_fraction=0.5, data_dir=str(data_dir))  # ignored
    cut = len(text) - round(len(text) * 0.1)
    # records were shuffled on disk; the index restores the stream byte for byte
    assert bytes(corpus.train_N.astype(np.uint8)) == text[:cut].encode("utf-8")
    assert bytes(corpus.val_M.astype(np.uint8)) == text[cut:].encode("utf-8")
    assert corpus.vocab_size == 256
    files = sorted(p.name for p in (data_dir / "plays" / "1.0.0").iterdir())
    assert any(".array_record-" in f for f in files) and "dataset_info.json" in files


def test_sentencepiece_round_trips_and_sets_the_vocabulary(text_file, data_dir):
    _, text = text_file
    tok = SentencePieceTokenizer(data_dir / "plays_sp" / "tokenizer.model")
    assert 256 < tok.vocab_size <= 400
    sample = text[1000:3000] + "é — ünïcode ✓\n"
    assert tok.decode(tok.encode(sample)) == sample
    assert len(tok.encode(sample)) < len(sample.encode("utf-8"))  # it compresses
    corpus = load_corpus("tfds:plays_sp", val_fraction=0.1, data_dir=str(data_dir))
    assert corpus.vocab_size == tok.vocab_size
    cut = len(text) - round(len(text) * 0.1)
    assert tok.decode(corpus.train_N) == text[:cut]


def test_shards_are_disjoint_and_cover_the_split(data_dir):
    corpus = load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(data_dir))
    shards_RxS = replica_shards(corpus.train_N, 4, 32)
    n = len(corpus.train_N)
    # contiguous, disjoint, in order: together they are the split (less the last n mod 4)
    np.testing.assert_array_equal(shards_RxS.reshape(-1), corpus.train_N[: n - n % 4])
    assert shards_RxS.shape == (4, n // 4)


def tiny(data_dir, name="plays", **extra):
    overrides = {"data.corpus": f"tfds:{name}", "data.data_dir": str(data_dir),
                 "parallel.runtime": "sim", "train.sample_chars": 20, "train.total_steps": 20,
                 "train.checkpoint_every": 10, "data.eval_windows": 0, **extra}  # fmt: skip
    return apply_overrides(load_preset(ROOT / "configs/tiny.py"),
                           [(k, str(v)) for k, v in overrides.items()])  # fmt: skip


@pytest.mark.slow  # 12 s; the round trip and vocabulary are checked by default
def test_train_on_a_sentencepiece_dataset(data_dir, tmp_path):
    cfg = tiny(data_dir, "plays_sp", **{"train.checkpoint": False, "train.total_steps": 10})
    done = train(cfg, tmp_path, show_progress=False)
    vocab = load_corpus("tfds:plays_sp", val_fraction=0.1, data_dir=str(data_dir)).vocab_size
    assert done["state"].params["head"]["kernel"].shape[-1] == vocab
    assert np.isfinite(done["final_eval_loss"]) and done["final_eval_loss"] < np.log(vocab)
    assert isinstance(done["sample"], str) and done["sample"].startswith("ROMEO.")


@pytest.mark.slow  # ~40 s; resume is exact by default on the shipped corpus (test_checkpoint)
def test_train_on_a_prepared_dataset_and_resume_exactly(data_dir, tmp_path):
    import shutil

    from tests.test_checkpoint import assert_bitwise_equal

    cfg = tiny(data_dir)
    full = train(cfg, tmp_path / "full", show_progress=False)
    assert np.isfinite(full["final_eval_loss"]) and full["final_eval_loss"] < np.log(256)
    train(cfg, tmp_path / "cut", show_progress=False)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "20")  # died after step 10
    resumed = train(cfg, tmp_path / "cut", show_progress=False)
    # the same batches after the resume: the same parameters, bit for bit
    assert_bitwise_equal(resumed["state"], full["state"])


def test_text_splits_by_slice(data_dir):
    full = load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(data_dir))
    half = load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(data_dir),
                       train_split="train[:50%]", eval_split="train[50%:]")  # fmt: skip
    # the two halves hold every training record once (records of 1,000 tokens)
    assert len(half.train_N) + len(half.val_M) == len(full.train_N)
    assert abs(len(half.train_N) - len(full.train_N) / 2) <= 1000


def test_eval_uses_the_whole_validation_split(data_dir):
    from diloco_jax.data import eval_windows

    corpus = load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(data_dir))
    windows = eval_windows(corpus.val_M, seq_len=32, max_windows=0)
    assert len(windows) == (len(corpus.val_M) - 1) // 32  # every window, whatever R is


def test_missing_dataset_is_one_clear_line(tmp_path):
    with pytest.raises(DataError, match="not found in .*python -m diloco_jax.data.prepare"):
        load_corpus("tfds:absent", val_fraction=0.1, data_dir=str(tmp_path))
    cmd = [sys.executable, "-m", "diloco_jax.train", "--config", "configs/tiny.py",
           "--workdir", str(tmp_path / "w"), "--config.data.corpus=tfds:absent",
           f"--config.data.data_dir={tmp_path}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "tfds:absent" not in errors[0] and "'absent'" in errors[0]
    assert not (tmp_path / "w").exists()


def test_prepare_cli_errors(tmp_path):
    from diloco_jax.data import prepare

    assert prepare.main(["--text", str(tmp_path / "none.txt"), "--out", str(tmp_path)]) == 2
    good = tmp_path / "t.txt"
    good.write_text("hello world\n" * 50)
    assert prepare.main(["--text", str(good), "--out", str(tmp_path), "--name", "Bad-Name"]) == 2


def test_a_split_over_the_budget_streams_from_a_token_file(data_dir):
    """Over data.max_memory_mib the training split is written once to an int32 token file and
    memory-mapped: the same tokens in the same order; a second load reuses the file; a split
    that fits stays in memory."""
    loaded = load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(data_dir))
    streamed = load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(data_dir),
                           max_bytes=1000)  # fmt: skip
    assert isinstance(streamed.train_N, np.memmap) and streamed.train_N.nbytes > 1000
    np.testing.assert_array_equal(streamed.train_N, loaded.train_N)
    np.testing.assert_array_equal(streamed.val_M, loaded.val_M)
    [path] = (data_dir / "plays").glob("_tokens-train.int32")
    written = path.stat().st_mtime_ns
    again = load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(data_dir), max_bytes=1000)
    assert path.stat().st_mtime_ns == written  # reused, not rewritten
    np.testing.assert_array_equal(again.train_N, loaded.train_N)
    half = load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(data_dir), max_bytes=1000,
                       train_split="train[:50%]")  # fmt: skip
    assert (data_dir / "plays" / "_tokens-train__50__.int32").is_file()  # its own file
    assert 0 < len(half.train_N) < len(loaded.train_N)
    fits = load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(data_dir), max_bytes=10**9)
    assert not isinstance(fits.train_N, np.memmap)
    np.testing.assert_array_equal(fits.train_N, loaded.train_N)


@pytest.mark.slow  # ~30 s: two tiny trainings
def test_a_streamed_tfds_run_trains_exactly_the_loaded_run(data_dir, tmp_path):
    from tests.test_checkpoint import assert_bitwise_equal

    off = {"train.checkpoint": False, "train.total_steps": 10}
    loaded = train(tiny(data_dir, **off), tmp_path / "loaded", show_progress=False)
    streamed = train(tiny(data_dir, **off, **{"data.max_memory_mib": 0.001}),
                     tmp_path / "streamed", show_progress=False)  # fmt: skip
    assert_bitwise_equal(streamed["state"], loaded["state"])
