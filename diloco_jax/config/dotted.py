"""A config by its dotted keys (``"outer.sync_every"``): every leaf with its type and
description, an override parsed from text, a value replaced, and a preset file loaded. The
schema itself (the dataclasses, each key's default and description) is
:mod:`~diloco_jax.config.schema`."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import pathlib
from typing import Any, NamedTuple, get_type_hints

from diloco_jax.base.errors import ConfigError
from diloco_jax.config import presets
from diloco_jax.config.schema import Config

_DEFAULT = Config()  # every key at its default (a Config is frozen)


def load_preset(preset: str | pathlib.Path) -> Config:
    """Runs ``get_config()`` of a preset: a file, or the name of a preset that comes with
    diloco-jax (``tiny``; :func:`diloco_jax.config.presets.find`)."""
    try:
        path = presets.find(preset)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    spec = importlib.util.spec_from_file_location(f"diloco_preset_{path.stem}", path)
    if spec is None or spec.loader is None:  # importlib reads .py files only
        raise ConfigError(f"config preset {path} is not a Python file (.py) with get_config()")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"cannot load config preset {path}: {type(e).__name__}: {e}") from None
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config preset {path} has no get_config() function")
    cfg = module.get_config()
    if not isinstance(cfg, Config):
        raise ConfigError(f"get_config() of {path} returned {type(cfg).__name__}, not Config")
    return cfg


class Key(NamedTuple):
    """One leaf of a config: its value, its type and its one-line description."""

    value: Any
    kind: type
    about: str


def described(cfg: Any = _DEFAULT, prefix: str = "") -> dict[str, Key]:
    """Every leaf key of ``cfg`` (``"outer.sync_every"``) with its value, type and description,
    in the schema's order."""
    out, kinds = {}, get_type_hints(type(cfg))
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value):
            out.update(described(value, f"{prefix}{field.name}."))
        else:
            out[f"{prefix}{field.name}"] = Key(value, kinds[field.name], field.metadata["about"])
    return out


def keys(cfg: Any = _DEFAULT) -> dict[str, Any]:
    """Every leaf key of ``cfg`` (``"outer.sync_every"``) with its value."""
    return {key: leaf.value for key, leaf in described(cfg).items()}


def parse_value(text: str, kind: type, key: str) -> Any:
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"config key {key}: {text!r} is not a bool (use true or false)")
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"config key {key}: {text!r} is not a valid {kind.__name__}") from None


def override(cfg: Config, key: str, text: str) -> Config:
    """Returns ``cfg`` with dotted ``key`` set to ``text`` parsed as the field's type."""
    known = described(cfg)
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown config key {key!r}{hint} (`--help` lists every key)")
    return replace(cfg, key, parse_value(text, known[key].kind, key))


def replace(cfg: Config, key: str, value: Any) -> Config:
    """Returns ``cfg`` with dotted ``key`` (a known key) set to ``value``."""
    *path, leaf = key.split(".")
    nodes = [cfg]
    for name in path:
        nodes.append(getattr(nodes[-1], name))
    for node, name in zip(reversed(nodes), reversed([*path, leaf]), strict=True):
        value = dataclasses.replace(node, **{name: value})
    return value


def apply_overrides(cfg: Config, overrides: list[tuple[str, str]]) -> Config:
    for key, text in overrides:
        cfg = override(cfg, key, text)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
