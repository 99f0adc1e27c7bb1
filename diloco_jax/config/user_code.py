"""The user's code named by import path in the config (``task.factory``,
``inner.optimizer``, ``outer.optimizer``): ``package.module:function``, imported with the
working directory on the path, as ``python -m`` would."""

from __future__ import annotations

import importlib
import pathlib
import sys
from collections.abc import Callable

from diloco_jax.base.errors import ConfigError


def function(path: str, key: str) -> Callable:
    """The function that ``path`` names; ConfigError naming the config ``key`` if its module
    cannot be imported or holds no such function."""
    where = f"config key {key} = {path!r}"
    module_name, _, name = path.partition(":")
    if str(pathlib.Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(pathlib.Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(f"{where}: cannot import {module_name}: "
                          f"{type(e).__name__}: {e}") from None  # fmt: skip
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{where}: {module_name} has no function {name!r}")
    return fn
