"""The external names the site links to, written as local Sphinx inventories at every build.

Sphinx's intersphinx links a name such as ``optax.GradientTransformation`` to its page on
optax's site by reading that site's ``objects.inv``, which it would download at each build. CI
has no network, so ``conf.py`` calls :func:`write`, which writes one small inventory per
project (``_generated/inventories/<project>.inv``, the same format) from :data:`PROJECTS`
below, and points ``intersphinx_mapping`` at those files. The links still lead to the real
sites: each entry is the page and anchor where that project documents the name.

Only the names the site mentions are listed. To link another one, add it under its project as
``"name": "page.html#anchor"`` (the address relative to the project's base URL; copy it from
the project's own page for the name) in the right role (``py:class``, ``py:function``, ...).
The nitpicky build (``sphinx-build -n -W``) fails on any reference that resolves nowhere, so a
missing name shows up there.
"""

from __future__ import annotations

import pathlib
import zlib

# project: (base URL, version, {role: {name: address relative to the base URL}})
PROJECTS: dict[str, tuple[str, str, dict[str, dict[str, str]]]] = {
    "python": ("https://docs.python.org/3", "3", {
        "py:class": {
            "bool": "library/functions.html#bool",
            "dict": "library/stdtypes.html#dict",
            "float": "library/functions.html#float",
            "int": "library/functions.html#int",
            "list": "library/stdtypes.html#list",
            "str": "library/stdtypes.html#str",
            "collections.abc.Callable": "library/collections.abc.html#collections.abc.Callable",
            "collections.abc.Mapping": "library/collections.abc.html#collections.abc.Mapping",
            "collections.abc.Sequence": "library/collections.abc.html#collections.abc.Sequence",
            "pathlib.Path": "library/pathlib.html#pathlib.Path",
        },
        "py:data": {"None": "library/constants.html#None"},
        "py:exception": {"ValueError": "library/exceptions.html#ValueError"},
    }),
    "numpy": ("https://numpy.org/doc/stable", "stable", {
        "py:class": {"numpy.ndarray": "reference/generated/numpy.ndarray.html#numpy.ndarray"},
    }),
    "jax": ("https://docs.jax.dev/en/latest", "latest", {
        "py:class": {"jax.Array": "_autosummary/jax.Array.html#jax.Array"},
        "py:function": {
            "jax.vmap": "_autosummary/jax.vmap.html#jax.vmap",
            "jax.lax.pmean": "_autosummary/jax.lax.pmean.html#jax.lax.pmean",
        },
    }),
    "optax": ("https://optax.readthedocs.io/en/latest", "latest", {  # a page per name
        "py:class": {
            "optax.GradientTransformation":
                "api/generated/optax.GradientTransformation.html#optax.GradientTransformation",
        },
        "py:function": {
            "optax.adamw": "api/generated/optax.adamw.html#optax.adamw",
            "optax.sgd": "api/generated/optax.sgd.html#optax.sgd",
            "optax.chain": "api/generated/optax.chain.html#optax.chain",
            "optax.clip_by_global_norm":
                "api/generated/optax.clip_by_global_norm.html#optax.clip_by_global_norm",
        },
    }),
    "flax": ("https://flax.readthedocs.io/en/latest", "latest", {
        "py:function": {"flax.nnx.split": "api_reference/flax.nnx/graph.html#flax.nnx.split"},
    }),
    "grain": ("https://google-grain.readthedocs.io/en/latest", "latest", {
        "py:class": {
            "grain.MapDataset": "grain.dataset.html#grain.MapDataset",
            "grain.IterDataset": "grain.dataset.html#grain.IterDataset",
            "grain.DataLoader": "grain.data_loader.html#grain.DataLoader",
        },
    }),
}  # fmt: skip


def inventory(project: str, version: str, entries: dict[str, dict[str, str]]) -> bytes:
    """``entries`` as a Sphinx inventory (version 2): a plain header, then one zlib-compressed
    line per name, ``name domain:role priority address display``; ``$`` in an address stands
    for the name, ``-`` as the display name for the name itself."""
    header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: {version}\n"
              "# The remainder of this file is compressed using zlib.\n")  # fmt: skip
    lines = []
    for role, names in entries.items():
        for name, address in sorted(names.items()):
            if address.endswith(f"#{name}"):
                address = address[: -len(name)] + "$"
            lines.append(f"{name} {role} 1 {address} -\n")
    return header.encode() + zlib.compress("".join(lines).encode())


def write(directory: pathlib.Path, srcdir: pathlib.Path) -> dict[str, tuple[str, str]]:
    """Writes every project's inventory into ``directory``; returns ``intersphinx_mapping``
    (each project's base URL and its inventory's path, relative to ``srcdir``)."""
    directory.mkdir(parents=True, exist_ok=True)
    mapping = {}
    for name, (base, version, entries) in PROJECTS.items():
        path = directory / f"{name}.inv"
        path.write_bytes(inventory(name, version, entries))
        mapping[name] = (base, str(path.relative_to(srcdir)))
    return mapping
