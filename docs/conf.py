"""Sphinx configuration of the diloco-jax site.

    uv run --group docs sphinx-build -W -b html docs docs/_build/html

The configuration reference (``_generated/configuration.md``) is written here, at every build,
from the config's own schema (``diloco_jax.config.described``: each key's type, default and
one-line description), so it cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's diloco_jax, whatever is installed

from diloco_jax import config as config_lib  # noqa: E402

project = "diloco-jax"
author = "the diloco-jax developers"
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
html_theme = "sphinx_book_theme"
html_title = "diloco-jax"
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _generated_doc(cls) -> bool:
    """Whether ``cls`` has no docstring of its own: a dataclass without one gets its
    signature (``DataConfig(corpus: 'str' = ...)``), which is no introduction."""
    return not cls.__doc__ or cls.__doc__.startswith(f"{cls.__name__}(")


def configuration_page() -> str:
    """Every config key by section: type, default (the ``default`` preset's schema) and what
    it does."""
    lines = [
        "# Configuration reference: every key",
        "",
        "Every key of the config, as `--config.KEY=VALUE` on the command line, a preset's "
        "`get_config()`, or `overrides={KEY: VALUE}` in `diloco_jax.fit`. Generated from the "
        "config's schema (`diloco_jax/config/schema.py`) when the site is built; the defaults are "
        "the schema's (a preset changes some of them).",
    ]
    sections: dict[str, list[tuple[str, config_lib.Key]]] = {}
    for key, value in config_lib.described().items():
        section = key.split(".")[0] if "." in key else "(top level)"
        sections.setdefault(section, []).append((key, value))
    docs = {
        f.name: (f.type, getattr(config_lib.Config(), f.name))
        for f in dataclasses.fields(config_lib.Config)
    }
    for section, rows in sections.items():
        lines += ["", f"## `{section}`" if section != "(top level)" else "## Top level", ""]
        value = docs.get(section, (None, None))[1]
        if dataclasses.is_dataclass(value) and not _generated_doc(type(value)):
            lines += [" ".join(type(value).__doc__.split()), ""]
        lines += ["| key | type | default | what it does |", "|---|---|---|---|"]
        for key, k in rows:
            lines.append(
                f"| `{key}` | {k.kind.__name__} | `{_cell(repr(k.value))}` | {_cell(k.about)} |"
            )
    return "\n".join(lines) + "\n"


(HERE / "_generated").mkdir(exist_ok=True)
(HERE / "_generated" / "configuration.md").write_text(configuration_page())

nb_execution_mode = "force"  # the tutorial's outputs come from running it in every build
nb_execution_timeout = 300
nb_execution_raise_on_error = True
