"""Where presets live and how ``--config NAME|PATH`` finds one.

A preset is a Python file with ``get_config()``. The presets that come with diloco-jax are the
files of ``configs/`` at the top of the repository; a wheel ships the same files as
``diloco_jax/configs/`` (``pyproject.toml`` maps them at build time), so a preset is found by
name (``tiny``) in a checkout and in an installed package alike. Any other file is named by its
path.
"""

from __future__ import annotations

import os
import pathlib

_HERE = pathlib.Path(__file__).resolve().parents[1]  # the package
# installed from a wheel: inside the package; a checkout (or an editable install): the repository's
DIRECTORY = _HERE / "configs" if (_HERE / "configs").is_dir() else _HERE.parent / "configs"
DEFAULT = DIRECTORY / "default.py"


def names() -> list[str]:
    """The names of the presets that come with diloco-jax, sorted."""
    return sorted(p.stem for p in DIRECTORY.glob("*.py") if not p.name.startswith("_"))


def find(preset: str | os.PathLike) -> pathlib.Path:
    """The preset file that ``preset`` names: an existing file is itself; otherwise a bare name
    (``tiny`` or ``tiny.py``) is the preset of that name that comes with diloco-jax. Raises
    ``FileNotFoundError`` with one line listing the presets' names."""
    path = pathlib.Path(preset)
    if path.is_file():
        return path
    name = path.name.removesuffix(".py")
    if str(preset) in (name, f"{name}.py") and (DIRECTORY / f"{name}.py").is_file():
        return DIRECTORY / f"{name}.py"
    raise FileNotFoundError(
        f"config preset not found: {preset} (give a preset file, or one of: {', '.join(names())})"
    )
