"""Sphinx configuration of the diloco-jax site.

    uv run --group docs sphinx-build -n -W -b html docs docs/_build/html

The configuration reference (``_generated/configuration.md``) is written here, at every build,
from the config's own schema (``diloco_jax.config.described``: each key's type, default and
one-line description), so it cannot drift from the code. So are the inventories of the external
names the API reference links to (``_inventories.py``: the build needs no network); with
``-n -W`` a cross-reference that resolves nowhere fails the build.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's diloco_jax, whatever is installed
sys.path.insert(0, str(HERE))  # _inventories.py, next to this file

import _inventories  # noqa: E402
from sphinx.pycode import ModuleAnalyzer  # noqa: E402

from diloco_jax import config as config_lib  # noqa: E402

project = "diloco-jax"
author = "the diloco-jax developers"
extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",  # [source] links from the API reference (no network needed)
]
html_theme = "sphinx_book_theme"
html_title = "diloco-jax"
# the theme's sidebar minus its search field: the header has one search box (Ctrl+K) already
html_sidebars = {"**": ["navbar-logo.html", "icon-links.html", "sbt-sidebar-nav.html"]}
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
        lines += [
            "",
            f"## `{section}`" if section != "(top level)" else "## Top level",
            "",
        ]
        value = docs.get(section, (None, None))[1]
        if dataclasses.is_dataclass(value) and not _generated_doc(type(value)):
            lines += [" ".join(type(value).__doc__.split()), ""]
        lines += [
            "| key | type | default | what it does |",
            "|---|---|---|---|",
        ]
        for key, k in rows:
            lines.append(
                f"| `{key}` | {k.kind.__name__} | `{_cell(repr(k.value))}` | {_cell(k.about)} |"
            )
    return "\n".join(lines) + "\n"


(HERE / "_generated").mkdir(exist_ok=True)
(HERE / "_generated" / "configuration.md").write_text(configuration_page())

intersphinx_mapping = _inventories.write(HERE / "_generated" / "inventories", HERE)

# Where autodoc finds an external type under a private path, the public name its project
# documents it as (the inventories hold only public names). A signature shows the public name
# in full (``optax.GradientTransformation``), as our own names show qualified by ``diloco_jax``.
PUBLIC_NAMES = {
    "optax._src.base.GradientTransformation": "optax.GradientTransformation",
    "jax.jaxlib._jax.Array": "jax.Array",
    # an alias a typing.NamedTuple leaves unevaluated in its constructor's signature
    "AxisName": "str | ~collections.abc.Sequence[str]",
}
_PRIVATE = re.compile(r"~?\b(" + "|".join(map(re.escape, PUBLIC_NAMES)) + r")\b")
# classes a user gets but does not construct: their constructor's signature is internal
NO_SIGNATURE = {
    "diloco_jax.Diloco",
    "diloco_jax.tasks.Problem",
    "diloco_jax.config.Config",
}
# constants diloco_jax re-exports, and the module whose ``#:`` comment documents each (autodoc
# reads none where a name is imported, and would show the docstring of the value's type, str)
CONSTANTS = {
    "diloco_jax.PER_REPLICA": "diloco_jax.algorithm.state",
    "diloco_jax.SHARED": "diloco_jax.algorithm.state",
}


def _public(text: str) -> str:
    return _PRIVATE.sub(lambda m: PUBLIC_NAMES[m.group(1)], text)


def _signature(app, what, name, obj, options, signature, return_annotation):
    """``autodoc-process-signature``: public names in signatures; none for NO_SIGNATURE."""
    if name in NO_SIGNATURE:
        return "", ""
    if signature is None:
        return None
    return _public(signature), _public(return_annotation or "")


def _docstring(app, what, name, obj, options, lines: list[str]) -> None:
    """``autodoc-process-docstring``, after napoleon: public names in the types it writes; a
    re-exported constant's ``#:`` comment."""
    if name in CONSTANTS:
        comments = ModuleAnalyzer.for_module(CONSTANTS[name]).find_attr_docs()
        lines[:] = comments[("", name.rpartition(".")[2])]
    lines[:] = [_public(line) for line in lines]


def setup(app):
    app.connect("autodoc-process-signature", _signature)
    app.connect("autodoc-process-docstring", _docstring, priority=600)  # napoleon's is 500


nb_execution_mode = "force"  # the tutorial's outputs come from running it in every build
nb_execution_timeout = 300
nb_execution_raise_on_error = True
