"""Counts, from the source, the imports of ``diloco_jax`` that point up its layers, and its
import circles, in any revision: the layers and the rules of ``tests/test_layout.py``.

    uv run python scripts/import_layers.py                 # the working tree
    uv run python scripts/import_layers.py --rev 0da3f5e   # a revision (git archive)

A revision from before the application was foldered (issue 40) had its application modules at
the package's top; each is counted in the layer it moved to (``OLD_HOME``), so the numbers of
two revisions compare one layering. Prints one markdown row per revision: modules, distinct
imports between them, those pointing up the layers, the modules they cross from, and the
circles (each strongly connected set of modules).
"""

from __future__ import annotations

import argparse
import io
import pathlib
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.test_layout import FACES, LAYERS, circles, graph, layer, upward  # noqa: E402

# the top-level modules of the package before issue 40 -> the layer each moved to
OLD_HOME = {
    "axes": "base", "randomness": "base", "extras": "base",
    "schedule": "simulated", "comms": "simulated",
    "config": "config", "presets": "config", "validation": "config", "recipe": "config",
    "user_code": "config", "user_optimizers": "config", "problems": "config", "cli": "config",
    "reporting": "watch", "records": "watch", "serve": "watch", "board": "watch",
    "figures": "watch", "drawing": "watch",
    "run_setup": "run", "placement": "run", "programs": "run", "resume": "run",
    "preemption": "run", "distributed": "run", "memory": "run", "live": "run",
}  # fmt: skip


def layer_then_or_now(module: str) -> str:
    top = module.split(".")[0]
    if "." not in module and top in OLD_HOME:
        return OLD_HOME[top]
    return layer(module)


def tree(rev: str | None) -> pathlib.Path:
    """The package's source at ``rev`` (None: the working tree)."""
    if rev is None:
        return ROOT / "diloco_jax"
    out = pathlib.Path(tempfile.mkdtemp(prefix="layers_"))
    data = subprocess.run(["git", "archive", rev, "diloco_jax"], cwd=ROOT, check=True,
                          capture_output=True).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(out, filter="data")
    return out / "diloco_jax"


def count(rev: str | None) -> dict:
    edges = graph(tree(rev))
    up = upward(edges, layer_then_or_now)
    return {
        "rev": rev or "working tree",
        "modules": len(edges),
        "imports": sum(len(v) for v in edges.values()),
        "upward": len(up),
        "from": sorted({a for a, _ in up}),
        "circles": circles(edges),
        "up": up,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", help="a git revision (repeatable)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list each upward import")
    args = parser.parse_args(argv)
    print(f"layers, bottom first: {', '.join(LAYERS)}; then the {FACES}")
    print("| revision | modules | imports | up the layers | circles |")
    print("|---|---|---|---|---|")
    results = [count(rev) for rev in (args.rev or [None])]
    for r in results:
        rings = "; ".join(" <-> ".join(c) for c in r["circles"]) or "none"
        print(f"| {r['rev']} | {r['modules']} | {r['imports']} | {r['upward']} | "
              f"{len(r['circles'])}: {rings} |")  # fmt: skip
    if args.verbose:
        for r in results:
            print(f"\n{r['rev']}:")
            for a, b in r["up"]:
                print(f"  {a} ({layer_then_or_now(a)}) -> {b} ({layer_then_or_now(b)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
