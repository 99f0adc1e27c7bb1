"""Optional packages: which extra of ``pyproject.toml`` installs each, and one-line errors.

The default install trains on the shipped data; TFDS datasets, image decoding, SentencePiece,
figures and W&B need an extra. An import site of an optional package calls :func:`require`
instead of importing it, so a missing package is one line naming the extra:

    reading tfds:mnist needs TensorFlow Datasets: uv sync --extra tfds (in /path/to/clone; ...)

:func:`check` says the same before any work starts, without importing anything.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
from types import ModuleType

# module -> (what it is, the extra that installs it)
EXTRAS = {
    "tensorflow_datasets": ("TensorFlow Datasets", "tfds"),
    "grain": ("Grain", "tfds"),
    "PIL": ("Pillow", "images"),
    "sentencepiece": ("SentencePiece", "sentencepiece"),
    "matplotlib": ("matplotlib", "plots"),
    "wandb": ("wandb", "wandb"),
    "grpc": ("gRPC (grpcio)", "learners"),
    "cryptography": ("cryptography", "learners"),
}


def checkout() -> pathlib.Path | None:
    """The clone of diloco-jax this package runs from (its ``pyproject.toml`` beside the
    package), or None for an installed wheel."""
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        return root if 'name = "diloco-jax"' in (root / "pyproject.toml").read_text() else None
    except OSError:
        return None


def install_hint(*modules: str) -> str:
    """What installs the extras of ``modules``, as it works from this repository (diloco-jax
    is not on a package index: a ``pip install 'diloco-jax[...]'`` would fetch whatever
    someone else published under the name): in a checkout ``uv sync --extra NAME`` there
    (its ``uv run`` keeps it), else pip from the clone."""
    names = list(dict.fromkeys(EXTRAS[m][1] for m in modules))
    root = checkout()
    if root is not None:
        flags = " ".join(f"--extra {n}" for n in names)
        return f"uv sync {flags} (in {root}; or pip install '{root}[{','.join(names)}]')"
    return f"pip install 'CLONE[{','.join(names)}]' (CLONE: your clone of diloco-jax)"


class MissingExtra(ImportError):
    """``feature`` needs optional ``modules`` that are not installed; the message is one line
    naming the extras to install."""

    def __init__(self, feature: str, modules: list[str], detail: str = ""):
        names = [EXTRAS[m][0] for m in modules]
        packages = " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))
        super().__init__(f"{feature} needs {packages}{detail}: {install_hint(*modules)}",
                         name=modules[0])  # fmt: skip
        self.extras = list(dict.fromkeys(EXTRAS[m][1] for m in modules))


def missing(*modules: str) -> list[str]:
    """The ``modules`` (keys of :data:`EXTRAS`) that are not installed; imports nothing."""
    absent = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package is missing, or __spec__ is None
            found = False
        if not found:
            absent.append(module)
    return absent


def check(feature: str, *modules: str) -> None:
    """Raises :class:`MissingExtra` naming every one of ``modules`` that is not installed."""
    absent = missing(*modules)
    if absent:
        raise MissingExtra(feature, absent)


def require(module: str, feature: str) -> ModuleType:
    """Imports ``module`` (a key of :data:`EXTRAS`, or a submodule of one), or raises
    :class:`MissingExtra` saying that ``feature`` needs it and which extra installs it."""
    top = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        # installed but broken (a dependency of it is missing): say what failed, on one line
        gone = e.name is None or e.name.partition(".")[0] == top
        detail = "" if gone else f" (importing it failed: {str(e).splitlines()[0]})"
        raise MissingExtra(feature, [top], detail) from None
