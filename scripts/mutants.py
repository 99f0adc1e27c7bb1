"""Mutation testing of our own: plant a known bug, run the tests that should see it, repeat.

``MUTANTS`` (scripts/mutant_list.py) is a fixed list of planted bugs (an outer step with the
wrong sign, a sync that leaves the replicas where they were, a checkpoint saved without the
outer state, a validation rule that lets a bad value through, ...). Each replaces one exact
snippet of one source file (it must occur there exactly once) and names the tests that should
fail on it. For every mutant the script copies the tree into a fresh directory under /tmp,
plants the bug there, runs

    <python> -m pytest -x -q -p no:cacheprovider -n 2 <the mutant's tests>

in that copy (its root comes first on ``sys.path``, and ``PYTHONPATH`` names it for the commands
tests start, so the mutated ``diloco_jax`` is the one imported) and reports which test caught
it: "caught" (a test failed: pytest exits 1, or 2 where pytest-xdist stops the run at the first
failure; the first ``FAILED`` or ``ERROR`` line names the test), "missed" (pytest exits 0: the
tests pass with the bug in place) or "error" (anything else: a module that fails to import, a
timeout, every selected test skipped; the run says nothing about the bug).

    uv run python scripts/mutants.py                     # every mutant, the working tree
    uv run python scripts/mutants.py --only checkpoint sign   # names, areas or files matching
    uv run python scripts/mutants.py --list              # the table; checks every snippet applies
    uv run python scripts/mutants.py --baseline          # each test selection once, no bug planted
    uv run python scripts/mutants.py --rev v0.1 --json out.json

The tree is the checkout as it is (``git ls-files``: tracked and untracked files that git does
not ignore). ``--rev REV`` takes ``git archive REV`` instead, with ``diloco_jax/``, ``sim/`` and
``configs/`` from the working tree: an older revision's tests run against today's source, to see
which planted bugs they would have caught. ``--baseline`` runs each distinct selection of tests
once without a bug: a selection that fails unmutated makes its mutants' results meaningless.

Prints a markdown table (``| # | area | planted bug | file | caught by | s |``) and "N of M
caught"; ``--json OUT`` also writes the results. Exits 1 if any mutant is not caught (missed, or
its run ended in error), so that CI or a person sees it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from mutant_list import AREAS, MUTANTS, Mutant  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("diloco_jax", "sim", "configs")  # with --rev: taken from the working tree
TAIL_LINES = 30


class MutantError(Exception):
    """A mutant that cannot be planted (its snippet is missing or not unique)."""


class Result(NamedTuple):
    mutant: Mutant
    outcome: str  # caught | missed | error
    caught_by: str  # the first failed test, or why the run said nothing
    seconds: float
    returncode: int | None  # None: timed out
    tail: str  # the output's last lines, for an error


def planted(source: str, m: Mutant) -> str:
    """``source`` with ``m``'s bug; raises :class:`MutantError` unless ``m.old`` occurs exactly
    once (a snippet found twice would plant the bug in the wrong place, or in two)."""
    count = source.count(m.old)
    if count != 1:
        raise MutantError(f"{m.path}: the snippet of {m.name!r} occurs {count} times, not once:"
                          f"\n{m.old}")  # fmt: skip
    return source.replace(m.old, m.new)


def _test_problems(m: Mutant, root: pathlib.Path) -> list[str]:
    """Test paths of ``m`` that do not exist in ``root`` (a file, or a function in it)."""
    problems = []
    for test in [t for t in m.tests if t and not t.startswith("-")]:  # not pytest's options
        file, _, function = test.partition("::")
        path = root / file
        if not file.startswith("tests/") or not path.is_file():
            problems.append(f"{m.name!r}: no test file {file}")
        elif function and f"def {function.split('[')[0]}(" not in path.read_text():
            problems.append(f"{m.name!r}: no test {function} in {file}")
    return problems


def problems(mutants: list[Mutant], root: pathlib.Path, *, tests: bool = True) -> list[str]:
    """Everything wrong with ``mutants`` against the source in ``root``: an unknown area, a
    snippet that does not occur exactly once, a mutated file that does not compile, and (with
    ``tests``) a test that does not exist there."""
    found = []
    for m in mutants:
        if m.area not in AREAS:
            found.append(f"{m.name!r}: area {m.area!r} is not one of {AREAS}")
        if m.old == m.new or not m.tests:
            found.append(f"{m.name!r}: plants nothing or names no test")
        try:
            new_source = planted((root / m.path).read_text(), m)
            compile(new_source, m.path, "exec")
        except (OSError, MutantError, SyntaxError) as e:
            found.append(f"{m.name!r}: {e}")
        if tests:
            found += _test_problems(m, root)
    return found


def checkout_files(root: pathlib.Path) -> list[str]:
    """The checkout's files: tracked, and untracked but not ignored (as they are on disk)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, check=True).stdout  # fmt: skip
    names = sorted(set(out.decode().split("\0")) - {""})
    return [n for n in names if (root / n).is_file() or (root / n).is_symlink()]


def copy_files(root: pathlib.Path, names: list[str], dest: pathlib.Path) -> None:
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target, follow_symlinks=False)


def build_tree(dest: pathlib.Path, rev: str | None) -> None:
    """The tree every mutant starts from: the checkout's files, or ``git archive rev`` with the
    source directories (:data:`SOURCE_DIRS`) replaced by the working tree's."""
    names = checkout_files(ROOT)
    if rev is None:
        copy_files(ROOT, names, dest)
        return
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT,
                             capture_output=True, check=True).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    for folder in SOURCE_DIRS:
        shutil.rmtree(dest / folder, ignore_errors=True)
    copy_files(ROOT, [n for n in names if n.split("/", 1)[0] in SOURCE_DIRS], dest)


def run_pytest(tree: pathlib.Path, tests: list[str], timeout: float) -> tuple[int | None, str]:
    """``(exit status or None on timeout, output)`` of pytest on ``tests`` in ``tree``. pytest
    runs in its own process group, so a timeout or a Ctrl-C here also ends its workers."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "2",
           *tests]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": path},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def first_failure(output: str) -> str:
    """The test named by the first ``FAILED`` line of pytest's summary, else the first
    ``ERROR`` line ('' if none)."""
    lines = output.splitlines()
    for word in ("FAILED ", "ERROR "):
        for line in lines:
            if line.startswith(word):
                return line[len(word) :].split(" - ", 1)[0].strip()
    return ""


def classify(returncode: int | None, output: str) -> tuple[str, str]:
    """``(outcome, caught_by)`` of one pytest run with a bug planted."""
    if returncode is None:
        return "error", "timed out"
    failed = first_failure(output)
    # under xdist, -x ends the run at the first failure by raising Interrupted in the controller:
    # exit 2 (not 1), after the same FAILED lines. A collection error takes that path too; its
    # ERROR line names a file, not a test
    stopped = returncode == 2 and re.search(r"stopping after \d+ failures", output)
    if (returncode == 1 or stopped) and "::" in failed:
        return "caught", failed
    if returncode == 0 and re.search(r"\b\d+ passed\b", output):
        return "missed", ""
    if returncode == 0:  # every selected test skipped: no verdict
        return "error", "no test ran (all skipped)"
    return "error", f"pytest exit {returncode}" + (f": {failed}" if failed else "")


def run_one(base: pathlib.Path, scratch: pathlib.Path, tests: list[str], timeout: float,
            m: Mutant | None = None) -> tuple[int | None, str, float]:  # fmt: skip
    """pytest on ``tests`` in a fresh copy of ``base`` (with ``m``'s bug planted, if given);
    ``(exit status, output, seconds)``. The copy is removed afterwards."""
    tree = pathlib.Path(tempfile.mkdtemp(prefix="tree-", dir=scratch))
    try:
        shutil.copytree(base, tree, symlinks=True, dirs_exist_ok=True)
        if m is not None:
            path = tree / m.path
            path.write_text(planted(path.read_text(), m))
        start = time.monotonic()
        returncode, output = run_pytest(tree, tests, timeout)
        return returncode, output, time.monotonic() - start
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def tail(output: str) -> str:
    return "\n".join(output.rstrip().splitlines()[-TAIL_LINES:])


def run_mutants(mutants: list[Mutant], base: pathlib.Path, scratch: pathlib.Path,
                timeout: float) -> list[Result]:  # fmt: skip
    results = []
    for i, m in enumerate(mutants, 1):
        print(f"[{i}/{len(mutants)}] {m.name} ({m.path})", file=sys.stderr, flush=True)
        returncode, output, seconds = run_one(base, scratch, m.tests, timeout, m)
        outcome, caught_by = classify(returncode, output)
        results.append(Result(m, outcome, caught_by, seconds, returncode,
                              tail(output) if outcome == "error" else ""))  # fmt: skip
        print(f"    {outcome} {caught_by} ({seconds:.0f} s)", file=sys.stderr, flush=True)
    return results


def run_baseline(mutants: list[Mutant], base: pathlib.Path, scratch: pathlib.Path,
                 timeout: float) -> bool:  # fmt: skip
    """Each distinct selection of tests once, no bug planted; prints a table; True if all
    passed."""
    selections = list(dict.fromkeys(tuple(m.tests) for m in mutants))
    rows, ok = [], True
    for i, tests in enumerate(selections, 1):
        print(f"[{i}/{len(selections)}] {' '.join(tests)}", file=sys.stderr, flush=True)
        returncode, output, seconds = run_one(base, scratch, list(tests), timeout)
        outcome, failed = classify(returncode, output)
        verdict = "passed" if outcome == "missed" else f"FAILS: {failed or outcome}"
        ok &= outcome == "missed"
        rows.append(f"| {i} | {'<br>'.join(tests)} | {verdict} | {seconds:.0f} |")
        if outcome != "missed":
            print(tail(output), file=sys.stderr)
    print("| # | tests | unmutated | s |\n|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{sum(r.split(' | ')[2] == 'passed' for r in rows)} of {len(rows)} selections pass")
    return ok


def list_table(mutants: list[Mutant]) -> str:
    rows = ["| # | area | planted bug | file | tests |", "|---|---|---|---|---|"]
    for i, m in enumerate(mutants, 1):
        rows.append(f"| {i} | {m.area} | {m.name} | `{m.path}` | {'<br>'.join(m.tests)} |")
    return "\n".join(rows)


def results_table(results: list[Result]) -> str:
    rows = ["| # | area | planted bug | file | caught by | s |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        by = f"`{r.caught_by}`" if r.outcome == "caught" else f"**{r.outcome}** {r.caught_by}"
        rows.append(f"| {i} | {r.mutant.area} | {r.mutant.name} | `{r.mutant.path}` | {by} "
                    f"| {r.seconds:.0f} |")  # fmt: skip
    return "\n".join(rows)


def write_json(path: str, results: list[Result], rev: str | None) -> None:
    rows = [{**r.mutant._asdict(), "outcome": r.outcome, "caught_by": r.caught_by,
             "seconds": round(r.seconds, 1), "returncode": r.returncode, "tail": r.tail}
            for r in results]  # fmt: skip
    summary = {"rev": rev or "working tree", "caught": sum(r.outcome == "caught" for r in results),
               "total": len(results), "mutants": rows}  # fmt: skip
    pathlib.Path(path).write_text(json.dumps(summary, indent=2) + "\n")


def select(mutants: list[Mutant], only: list[str] | None) -> list[Mutant]:
    """The mutants whose name, area or file contains one of ``only`` (case-insensitive)."""
    if not only:
        return list(mutants)
    words = [w.lower() for w in only]
    return [m for m in mutants
            if any(w in f"{m.name}\n{m.area}\n{m.path}".lower() for w in words)]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="run REV's tests (git archive) against the working tree's "
                        "diloco_jax/, sim/ and configs/")  # fmt: skip
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="SUBSTR",
        help="only mutants whose name, area or file contains one of these",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the mutants and check that each applies; run nothing",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="run each distinct test selection once without a mutation",
    )
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--tests", nargs="+", metavar="TEST",
                        help="run these tests for every selected mutant instead of its own (a "
                        "test moved to the slow set, run by name: -m '' is added)")  # fmt: skip
    parser.add_argument(
        "--timeout",
        type=float,
        default=1200.0,
        metavar="SECONDS",
        help="per pytest run (default 1200)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mutants = select(MUTANTS, args.only)
    if args.tests:
        mutants = [m._replace(tests=["-m", "", *args.tests]) for m in mutants]
    if not mutants:
        print(f"no mutant matches {args.only}", file=sys.stderr)
        return 2
    # the tests are checked here unless they come from another revision (then in its tree)
    found = problems(mutants, ROOT, tests=args.list or not args.rev)
    if args.list:
        print(list_table(mutants))
    if found:  # before any run: a snippet that does not apply would waste the whole session
        print("\n".join(["", "mutants that do not apply:", *found]), file=sys.stderr)
        return 1
    if args.list:
        print(f"\n{len(mutants)} mutants; every snippet occurs once and compiles mutated")
        return 0
    if args.rev and not is_commit(args.rev):
        print(f"--rev {args.rev}: no such commit", file=sys.stderr)
        return 2
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="diloco_mutants_", dir="/tmp"))
    try:
        base = scratch / "base"
        build_tree(base, args.rev)
        if args.rev and (missing := [p for m in mutants for p in _test_problems(m, base)]):
            # their runs end in error (pytest finds no such test); the others still tell
            print("\n".join([f"tests missing at {args.rev}:", *missing]), file=sys.stderr)
        if args.baseline:
            return 0 if run_baseline(mutants, base, scratch, args.timeout) else 1
        results = run_mutants(mutants, base, scratch, args.timeout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report(results, args)


def is_commit(rev: str) -> bool:
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           cwd=ROOT, capture_output=True)  # fmt: skip
    return found.returncode == 0


def report(results: list[Result], args: argparse.Namespace) -> int:
    """Prints the table, the summary and every error's output; 1 if any mutant was not caught."""
    print(results_table(results))
    caught = sum(r.outcome == "caught" for r in results)
    print(
        f"\n{caught} of {len(results)} caught"
        + (f" (tests of {args.rev}, source of the working tree)" if args.rev else "")
    )
    for r in results:
        if r.outcome == "error":
            print(f"\n### {r.mutant.name}: {r.caught_by}\n```\n{r.tail}\n```")
    if args.json:
        write_json(args.json, results, args.rev)
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
