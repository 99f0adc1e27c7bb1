"""Optional packages (pyproject's extras): each import site names its extra in one line when the
package is missing, and the entry points refuse up front (exit 2) before anything is trained or
written; the simulator still writes its tables without matplotlib.

A package is made missing with ``sys.modules[name] = None``, which makes ``import name`` raise
ImportError (and ``importlib.util.find_spec`` return None) as if it were not installed.
"""

import csv
import importlib.metadata
import io
import pathlib
import re
import sys
import tomllib

import numpy as np
import pytest

from diloco_jax.base import extras
from diloco_jax.data import tfds_io, tfds_text
from diloco_jax.data.prepare import main as prepare_main
from diloco_jax.train import main as train_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _missing(monkeypatch, *modules: str) -> None:
    for module in modules:
        for name in [n for n in sys.modules if n.startswith(f"{module}.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, module, None)


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line.startswith("error: ") and "Traceback" not in err, err
    return line


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def test_every_optional_module_is_in_its_extra_and_not_a_default_dependency():
    optional = PYPROJECT["optional-dependencies"]
    default = _requirement_names(PYPROJECT["dependencies"])
    distributions = importlib.metadata.packages_distributions()  # module -> distributions
    for module, (_, extra) in extras.EXTRAS.items():
        (dist,) = {d.lower() for d in distributions[module]}  # every extra is in the dev group
        assert dist in _requirement_names(optional[extra]), (module, extra)
        assert dist not in default, dist
    # `all` installs every extra but the CUDA build of JAX
    others = [e for e in optional if e not in ("all", "cuda12")]
    assert optional["all"] == [f"diloco-jax[{','.join(others)}]"]
    assert {"scikit-learn", "chex", "matplotlib", "pillow"}.isdisjoint(default)


def test_the_install_hint_is_what_works_from_this_repository(monkeypatch, tmp_path):
    """Item 7 of issue 61: diloco-jax is not on a package index, so no hint says ``pip install
    'diloco-jax[...]'`` (someone else's package of that name would be installed). In a
    checkout: ``uv sync --extra NAME`` there, or pip from its path; from a wheel: pip from the
    clone."""
    root = pathlib.Path(__file__).resolve().parents[1]
    assert extras.checkout() == root
    assert extras.install_hint("grpc", "cryptography") == (
        f"uv sync --extra learners (in {root}; or pip install '{root}[learners]')"
    )
    monkeypatch.setattr(extras, "checkout", lambda: None)
    assert extras.install_hint("PIL", "grain") == (
        "pip install 'CLONE[images,tfds]' (CLONE: your clone of diloco-jax)"
    )
    assert "diloco-jax[" not in extras.install_hint("PIL", "grain")


def test_require_names_the_extra_and_what_failed(monkeypatch, tmp_path):
    _missing(monkeypatch, "sentencepiece")
    with pytest.raises(extras.MissingExtra) as e:
        extras.require("sentencepiece", "reading tokenizer.model")
    assert str(e.value) == (
        f"reading tokenizer.model needs SentencePiece: {extras.install_hint('sentencepiece')}"
    )
    assert isinstance(e.value, ImportError) and e.value.extras == ["sentencepiece"]
    # several at once, one line; submodules count as their package
    _missing(monkeypatch, "PIL", "grain")
    with pytest.raises(extras.MissingExtra, match=r"^x needs Pillow and Grain: uv sync --extra "
                       r"images --extra tfds \(in .*\[images,tfds\]'\)$"):  # fmt: skip
        extras.check("x", "PIL", "grain", "numpy")
    with pytest.raises(extras.MissingExtra, match=r"\[images\]'\)$"):
        extras.require("PIL.Image", "x")
    # installed but broken: the line says what its import lacked
    (tmp_path / "grain.py").write_text("import no_such_module_of_grain\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "grain")
    with pytest.raises(extras.MissingExtra) as e:
        extras.require("grain", "reading text")
    assert "(importing it failed: No module named 'no_such_module_of_grain')" in str(e.value)
    assert "\n" not in str(e.value)


def test_train_without_tfds_refuses_a_tfds_corpus_before_anything(monkeypatch, tmp_path, capsys):
    _missing(monkeypatch, "tensorflow_datasets")
    run = tmp_path / "run"
    code = train_main(["--config", "tiny", "--workdir", str(run),
                       "--config.data.corpus=tfds:mnist"])  # fmt: skip
    assert code == 2
    assert _one_error_line(capsys) == (
        "error: config key data.corpus = 'tfds:mnist' needs TensorFlow Datasets: "
        f"{extras.install_hint('tensorflow_datasets')}"
    )
    assert not run.exists()


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """A TFDS image dataset (4 PNG images) and a text dataset with a SentencePiece tokenizer."""
    import tensorflow_datasets as tfds
    from PIL import Image

    root = tmp_path_factory.mktemp("tfds")

    def png(value):
        out = io.BytesIO()
        Image.fromarray(np.full((4, 4), value, np.uint8)).save(out, format="PNG")
        return out.getvalue()

    def features():
        image, label = tfds.features.Image(shape=(4, 4, 1)), tfds.features.ClassLabel(num_classes=2)
        return tfds.features.FeaturesDict({"image": image, "label": label})

    examples = {split: [(i, {"image": png(40 * i), "label": i % 2}) for i in range(4)]
                for split in ("train", "test")}  # fmt: skip
    tfds_io.write("pixels", root, features, {s: (lambda e=e: iter(e)) for s, e in examples.items()})
    (root / "plays.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    tfds_text.prepare([root / "plays.txt"], root, name="plays", tokenizer="sentencepiece",
                      vocab_size=300, val_fraction=0.2)  # fmt: skip
    return root


@pytest.mark.parametrize(
    "corpus,module,extra",
    [("pixels", "PIL", "images"), ("plays", "sentencepiece", "sentencepiece"),
     ("plays", "grain", "tfds")],
)  # fmt: skip
def test_train_refuses_a_dataset_whose_extra_is_missing(
    datasets, corpus, module, extra, monkeypatch, tmp_path, capsys
):
    _missing(monkeypatch, module)
    run = tmp_path / "run"
    code = train_main(["--config", "tiny", "--workdir", str(run), f"--config.data.corpus=tfds:"
                       f"{corpus}", f"--config.data.data_dir={datasets}"])  # fmt: skip
    assert code == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: config key data.corpus = 'tfds:{corpus}'")
    assert line.endswith(f"[{extra}]')")
    assert not run.exists()


def test_library_import_sites_raise_missing_extra(datasets, monkeypatch):
    from diloco_jax.data import load_corpus, tfds_images
    from diloco_jax.data.tokenizer import SentencePieceTokenizer
    from diloco_jax.watch.reporting import WandbWriter

    _missing(monkeypatch, "PIL", "sentencepiece", "wandb")
    with pytest.raises(extras.MissingExtra, match=r"pixels needs Pillow.*\[images\]'\)$"):
        tfds_images.load("tfds:pixels", str(datasets))
    with pytest.raises(extras.MissingExtra, match=r"needs SentencePiece.*\[sentencepiece\]'\)$"):
        load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(datasets))
    with pytest.raises(extras.MissingExtra, match=r"needs SentencePiece"):
        SentencePieceTokenizer(datasets / "plays" / "tokenizer.model")
    with pytest.raises(extras.MissingExtra, match=r"Weights & Biases logging needs wandb.*"
                       r"\[wandb\]'\)$"):  # fmt: skip
        WandbWriter(pathlib.Path("unused"), project="p", mode="offline", config={})
    _missing(monkeypatch, "tensorflow_datasets")
    with pytest.raises(extras.MissingExtra, match=r"reading tfds:plays needs TensorFlow Datasets"):
        load_corpus("tfds:plays", val_fraction=0.1, data_dir=str(datasets))


@pytest.mark.parametrize(
    "flags,module,extra",
    [(["--text", "{T}/a.txt"], "tensorflow_datasets", "tfds"),
     (["--text", "{T}/a.txt", "--tokenizer", "sentencepiece"], "sentencepiece", "sentencepiece"),
     (["--images", "{T}"], "PIL", "images")],
)  # fmt: skip
def test_prepare_refuses_before_writing(flags, module, extra, monkeypatch, tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text to prepare\n" * 10)
    _missing(monkeypatch, module)
    out = tmp_path / "out"
    code = prepare_main([f.replace("{T}", str(tmp_path)) for f in flags] + ["--out", str(out)])
    assert code == 2
    assert _one_error_line(capsys).endswith(f"[{extra}]')")
    assert not out.exists()


def test_sweep_without_matplotlib_writes_the_tables_and_says_so(monkeypatch, tmp_path, capsys):
    import json

    from sim.__main__ import main

    def train(cfg, rundir, **_):  # what a finished run leaves, without training
        rundir.mkdir(parents=True)
        with open(rundir / "metrics.jsonl", "w") as f:
            for step, loss in ((5, 2.5), (10, 2.25)):
                f.write(json.dumps({"event": "eval", "step": step, "eval_loss": loss,
                                    "tokens": step * 512}) + "\n")  # fmt: skip
        return {"final_eval_loss": 2.25, "steps": 10, "tokens": 5120, "step_seconds": 0.01,
                "preempted": None, "state": None}  # fmt: skip

    monkeypatch.setattr("diloco_jax.train.train", train)
    _missing(monkeypatch, "matplotlib")
    assert main(["--config", "tiny", "--workdir", str(tmp_path), "--sweep",
                 "outer.sync_every=1,5"]) == 0  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    note = ("note: the figures (curves, tradeoff, drift, cosine) are not drawn (they need "
            f"matplotlib): {extras.install_hint('matplotlib')}")  # fmt: skip
    assert err.count(note) == 1 and err.index(note) == 0, err  # at the start, once
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [(r["run"], r["final_eval_loss"]) for r in rows] == [
        ("sync_every=1", "2.25"), ("sync_every=5", "2.25")]  # fmt: skip
    assert len(list(csv.DictReader(open(tmp_path / "summary.csv")))) == 2
    assert not list(tmp_path.glob("*.png"))


def test_combine_without_matplotlib_refuses_up_front(monkeypatch, tmp_path, capsys):
    from sim import combine

    _missing(monkeypatch, "matplotlib")
    out = tmp_path / "out"
    assert combine.main([str(tmp_path), "--out", str(out)]) == 2
    assert _one_error_line(capsys) == (
        f"error: drawing tradeoff.png needs matplotlib: {extras.install_hint('matplotlib')}"
    )
    assert not out.exists()


def test_a_run_without_matplotlib_draws_no_figures(monkeypatch, tmp_path):
    import json

    from diloco_jax.watch import figures

    sync = {"event": "sync", "step": 5, "outer_step": 1, "drift": [1.0], "cosine_to_mean": [1.0]}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(sync) + "\n")
    _missing(monkeypatch, "matplotlib")
    assert figures.run_diagnostics(tmp_path) == [] and not list(tmp_path.glob("*.png"))
    monkeypatch.undo()
    assert figures.run_diagnostics(tmp_path) == ["drift.png", "cosine.png"]


def test_a_run_without_matplotlib_says_once_that_its_figures_are_not_drawn(
        monkeypatch, tmp_path, caplog):  # fmt: skip
    """``log.figures`` on and no ``plots`` extra: drift.png and cosine.png are not drawn, and one
    warning names the extra (issue 54: it used to be silent)."""
    import logging

    from diloco_jax.watch import figures

    _missing(monkeypatch, "matplotlib")
    with caplog.at_level(logging.WARNING, "diloco_jax"):
        assert figures.run_diagnostics(tmp_path) == []
    lines = [r.getMessage() for r in caplog.records]
    assert (
        len(lines) == 1
        and extras.install_hint("matplotlib") in lines[0]
        and "not drawn" in lines[0]
    )
    assert not list(tmp_path.iterdir())
