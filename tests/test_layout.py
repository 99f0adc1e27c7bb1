"""The folder layout's dependency directions (docs/architecture.md): the algorithm imports
nothing of the runtime, the tasks or the application; the runtime and the tasks never read the
config. Checked on the source, so a new import that breaks the layout fails here."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "diloco_jax"
ALLOWED = {  # folder -> the diloco_jax modules and folders it may import
    "algorithm": {"algorithm", "axes"},
    "tasks": {"tasks", "data", "randomness"},
    "runtime": {"runtime", "algorithm", "tasks", "axes", "randomness"},
}


def _imported(path: pathlib.Path) -> set[str]:
    """The first name under ``diloco_jax`` of every import in ``path``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] == "diloco_jax":
                names |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[1] for a in node.names
                      if a.name.startswith("diloco_jax.")}  # fmt: skip
    return names


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folder_imports_only_what_the_layout_allows(folder):
    files = sorted((PACKAGE / folder).glob("*.py"))
    assert files, folder
    for path in files:
        bad = _imported(path) - ALLOWED[folder]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_the_check_sees_imports():
    """The parser finds both import forms, so the layout test cannot pass by seeing nothing."""
    assert _imported(PACKAGE / "runtime" / "step.py") == {"randomness", "runtime", "tasks"}
    assert {"runtime", "cli", "run_setup"} <= _imported(PACKAGE / "train.py")
    assert {"algorithm", "runtime", "tasks"} <= _imported(PACKAGE / "run_setup.py")
