"""The package's layout (docs/architecture.md): its folders form layers, each importing only its
own modules and the layers below it, and no module imports in a circle. Checked on the source
(every import, those inside functions too), so a new import against the layout fails here.
``scripts/import_layers.py`` counts, with the same rules, the imports that point up the layers
in any revision."""

from __future__ import annotations

import ast
import pathlib
import textwrap

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "diloco_jax"

# The layers, bottom first: a module imports its own folder's modules and those of the layers
# below it, never one above. The top-level modules (the package's faces: __init__, fit, train,
# launch, commands) sit above them all.
LAYERS = (
    "base",  # axes' names, random keys, optional packages, the config error, command-line parser
    "algorithm",  # DiLoCo and its variants as optax-style transforms: no devices, no config
    "simulated",  # the simulated world: who is present when (schedules), the network's cost
    "data",  # corpora, images, TFDS, streaming from disk
    "tasks",  # the task interface, the built-in models and tasks
    "runtime",  # one replica step under vmap or shard_map, checkpoints, the compile cache
    "config",  # the schema, presets, command lines, validation, config -> algorithm and task
    "watch",  # logs, records, the HTTP server and dashboard, figures
    "learners",  # independent learners and their syncer: the wire format, gRPC, the rounds
    "run",  # a run's life: set-up, placement, resume, the loop, processes, preemption
)
FACES = "faces"  # the top-level modules


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``run.loop`` for ``root/run/loop.py``; a package's ``__init__`` is the package itself
    (``""`` for the root's own)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _target(root: pathlib.Path, dotted: str) -> str | None:
    """``dotted`` (a path under the package) if it names a module or package there."""
    base = root.joinpath(*dotted.split(".")) if dotted else root
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
        return dotted
    return None


def imports(path: pathlib.Path, root: pathlib.Path, package: str = "diloco_jax") -> set[str]:
    """The modules of the package that ``path`` imports, anywhere in it: for ``from P import
    n``, the module ``P.n`` where there is one, else ``P``."""
    here = module_name(path, root).split(".") if module_name(path, root) else []
    if path.name != "__init__.py":
        here = here[:-1]  # the importing module's package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    found.add(alias.name.removeprefix(package).lstrip("."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importing module's package
                parts = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                base = ".".join([*parts, *(node.module.split(".") if node.module else [])])
            elif node.module and (node.module == package or
                                  node.module.startswith(package + ".")):  # fmt: skip
                base = node.module.removeprefix(package).lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                found.add(_target(root, sub) or base)
    return found


def graph(root: pathlib.Path = PACKAGE, package: str = "diloco_jax") -> dict[str, set[str]]:
    """Module -> the modules of the package it imports."""
    return {module_name(p, root): imports(p, root, package) for p in sorted(root.rglob("*.py"))}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of modules (Tarjan's algorithm), and
    each module that imports itself."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or v in edges.get(v, ()):
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> str:
    """The layer of a module of the current layout (``run.loop`` -> ``run``)."""
    top = module.split(".")[0]
    return top if top in LAYERS and "." in module or module in LAYERS else FACES


def rank(name: str) -> int:
    return LAYERS.index(name) if name in LAYERS else len(LAYERS)


def upward(edges: dict[str, set[str]], layer_of=layer) -> list[tuple[str, str]]:
    """Imports that point up the layers: ``(importer, imported)``."""
    return sorted((a, b) for a, bs in edges.items() for b in bs
                  if rank(layer_of(b)) > rank(layer_of(a)))  # fmt: skip


def test_every_folder_is_a_layer_and_every_top_level_module_a_face():
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(LAYERS)
    faces = {p.stem for p in PACKAGE.glob("*.py")}
    assert faces == {"__init__", "fit", "train", "launch", "syncer", "commands"}


def test_no_module_imports_a_layer_above_its_own():
    bad = upward(graph())
    assert not bad, "imports up the layers (tests/test_layout.py LAYERS): " + ", ".join(
        f"{a} -> {b}" for a, b in bad
    )


def test_no_import_circle():
    assert circles(graph()) == []


def test_the_checks_see_imports_circles_and_upward_imports(tmp_path):
    """Planted in a package of four modules: a circle through a function-level import and a
    relative one, an import up the layers, and both import forms read."""
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "base/__init__.py": "",
        "base/low.py": "from pkg.run import top\n",  # up the layers
        "run/__init__.py": "",
        "run/top.py": "import pkg.run.mid\n",
        "run/mid.py": "def f():\n    from . import top\n",  # a circle: top -> mid -> top
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    edges = graph(root, "pkg")
    assert edges["run.top"] == {"run.mid"} and edges["run.mid"] == {"run.top"}
    assert circles(edges) == [["run.mid", "run.top"]]
    assert upward(edges) == [("base.low", "run.top")]


def test_the_real_graph_is_read():
    """The parser finds the package's own imports, so the checks cannot pass by seeing none."""
    edges = graph()
    assert {"run.setup", "run.loop", "config.cli"} <= edges["train"]
    assert {"base.randomness", "runtime.fsdp", "tasks"} <= edges["runtime.step"]
    assert "config.schema" in edges["config.validation"]
