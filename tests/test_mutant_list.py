"""The planted bugs of ``scripts/mutants.py`` stay plantable as the code moves: each snippet
occurs once in its file, the file compiles with the bug in, and each names a test that exists.
(Two snippets went stale once without anyone knowing until the script ran.)"""

import importlib
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_planted_bug_applies_and_names_a_test_that_exists():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        mutants = importlib.import_module("mutants")
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert mutants.problems(mutants.MUTANTS, ROOT) == []
    assert len(mutants.MUTANTS) >= 81
