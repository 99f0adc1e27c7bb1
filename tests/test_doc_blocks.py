"""Every fenced code block of README.md and the guides (docs/guides/*.md) runs in a test
(issue 54).

How each block is checked, by its language:
- ``python``: a page's blocks run in order in one namespace, a later block building on an
  earlier one, in a child process that sees the CPU as a user's interpreter does. An
  ``{include}`` of another page's lines brings that page's blocks in where it stands. Blocks at
  a page's end that tests/test_readme.py runs and checks on their own (found by their
  ``<!-- name -->``: the README's task example, the library and grain examples) are left to it.
- ``bash`` (``sh``, ``shell``, ``console``): every block passes ``bash -n``. A block that
  trains (a command of train, sim, launch or the syncer, or a ``scripts/bench_*.py``) runs as
  written in a slow test; in the default suite its commands are parsed by their own parsers
  instead: the presets, keys and values they name exist (a benchmark's flags, in its source).
  Any other block runs as written in the default suite.
- ``json``, ``toml``: parsed. No language, or another: not code (output, a folder layout); such
  a block with a line that starts like a shell command fails, to be tagged ``bash``.
Whatever runs, no run it starts may be one that never syncs (the run's one-line notice).

A block that cannot run has ``<!-- not-run: <reason> -->`` right above its fence (other
comment lines, an include's ``<!-- name -->``, may sit between); GitHub and MyST hide it. A mark
without a reason, or one not above a fence, fails.

What is changed to run a block here, and nothing else (no flag of a block is touched but by the
last rule):
- it runs in a fresh folder holding links to the repository's ``configs/`` and ``scripts/``,
  with HOME (``~/tensorflow_datasets``) in that folder too, and the files its page assumes the
  reader has (INPUTS: ``mytask.py``, ``mymodule.py``, ``my_corpus/``, ``my_photos/``);
- ``/tmp/`` in a block is that folder's ``tmp/``, so runs never meet another's folders;
- ``uv run CMD`` runs ``CMD`` with this environment's ``bin/`` first on PATH (a ``uv`` shim):
  the suite already runs in the project's environment, synced;
- a command that trains the default preset (1000 steps, minutes on 2 cores) gets SHORTER
  appended: 100 steps, two outer steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib

import numpy as np
import pytest

from tests.helpers import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
# a line of an untagged block that starts like this is a command: the block should say bash
COMMAND_START = re.compile(r"^\s*(\$ |uv |python3? |pip |curl |srun |sbatch |bash |scripts/\S+\.)")
COMMENT = re.compile(r"^<!--.*-->\s*$")
NAME = re.compile(r"^<!--\s*([\w-]+)\s*-->\s*$")
NOT_RUN = re.compile(r"^<!--\s*not-run\b:?(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
SHORTER = "--config.train.total_steps=100"
# the entry points whose commands train (run by the slow tests, parsed by the default suite)
TRAINING = ("diloco_jax.train", "diloco_jax.launch", "diloco_jax.syncer", "sim")
BENCH = re.compile(r"scripts/bench_\w+\.py")  # benchmarks: they train too


@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # the opening fence's, 1-based
    lang: str  # the info string's first word ("" without one; "{include}" for a directive)
    code: str
    not_run: str | None  # the mark's reason ("" for a mark without one), None if unmarked
    argument: str = ""  # the info string's rest (a directive's argument: the included file)
    name: str = ""  # a ``<!-- name -->`` right above it (tests/test_readme.py finds it so)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _comments(lines: list[str], i: int, step: int) -> int:
    """The first line from ``i`` on (going by ``step``) that is not an HTML comment line."""
    while 0 <= i < len(lines) and COMMENT.match(lines[i]):
        i += step
    return i


def parse_blocks(page: pathlib.Path, text: str | None = None, first_line: int = 1):
    """``(blocks, problems)`` of a Markdown page: its fenced blocks in order, and a line for
    each not-run mark that is not right before a fence (other comment lines between them, as
    an include's ``<!-- name -->``, are fine)."""
    lines = (page.read_text() if text is None else text).splitlines()
    blocks, problems, i = [], [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            after = _comments(lines, i + 1, 1)
            if NOT_RUN.match(lines[i]) and not (after < len(lines) and FENCE.match(lines[after])):
                problems.append(f"{page.name}:{first_line + i}: a not-run mark not before a fence")
            i += 1
            continue
        fence, indent = opening.group("fence"), len(opening.group("indent"))
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence[0] * len(fence))
                    and not lines[j].strip().strip(fence[0])), len(lines))  # fmt: skip
        code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        above = lines[_comments(lines, i - 1, -1) + 1 : i]
        reason = next((r.group("reason").strip() for r in map(NOT_RUN.match, above) if r), None)
        name = next((n.group(1) for n in map(NAME.match, above) if n), "")
        lang, _, argument = opening.group("info").strip().partition(" ")
        blocks.append(Block(page, first_line + i, lang, code, reason, argument.strip(), name))
        i = end + 1
    return blocks, problems


def included(block: Block) -> list[Block]:
    """The blocks an ``{include}`` directive brings in (its ``:start-after:`` and
    ``:end-before:`` honoured), numbered by their lines in the included page."""
    page = (block.page.parent / block.argument).resolve()
    text = page.read_text()
    opts = dict(re.match(r":([\w-]+):\s*(.*)", o).groups() for o in block.code.splitlines())
    after = opts.get("start-after")
    start = text.index(after) + len(after) if after else 0
    end = text.index(opts["end-before"], start) if "end-before" in opts else len(text)
    return parse_blocks(page, text[start:end], text.count("\n", 0, start) + 1)[0]


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in parse_blocks(page)[0]]


def commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block, as words (continued lines joined, comments and
    ``$ `` prompts dropped; in a console block only the prompted lines are commands)."""
    prompted = any(line.startswith("$ ") for line in code.splitlines())
    found = []
    for line in code.replace("\\\n", " ").splitlines():
        if prompted:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # a $( ... ) across lines: not a command this file parses
            continue
        if words:
            found.append(words)
    return found


def entry_point(words: list[str]) -> tuple[str, list[str]] | None:
    """``(module, argv)`` of a command that runs one of the package's entry points (through
    ``uv run``, ``srun``, ``python -m`` or scripts/launch_local.sh), else None."""
    while words and words[0] in ("uv", "run", "srun"):
        words = words[1:]
    if words and words[0].endswith("launch_local.sh"):
        return "diloco_jax.launch", ["-n", *words[1:]]
    if len(words) >= 3 and re.fullmatch(r"(.*/)?python3?", words[0]) and words[1] == "-m":
        return words[2], words[3:]
    if len(words) >= 2 and re.fullmatch(r"(.*/)?python3?", words[0]) and BENCH.fullmatch(words[1]):
        return words[1], words[2:]  # a benchmark: it trains, for a minute or more
    return None


def _training(module: str) -> bool:
    return module in TRAINING or bool(BENCH.fullmatch(module))


def trains(block: Block) -> bool:
    return any((e := entry_point(w)) and _training(e[0]) for w in commands(block.code))


# --- the files a page assumes its reader has ------------------------------------------------

MYTASK = """\
import jax.numpy as jnp
import numpy as np
import diloco_jax


def make(n=1024, seed=0):
    x_NxD = np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32)
    data = {"x": x_NxD, "y": x_NxD @ np.array([1.0, -2.0, 0.5], np.float32)}

    def loss(params, batch, rng):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    return diloco_jax.ArrayTask({"w": np.zeros(3, np.float32)}, loss, data)
"""
MYMODULE = """\
import optax


def make_inner(lr):
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))
"""


def _corpus(folder: pathlib.Path) -> None:
    from diloco_jax.data import corpus

    text = corpus.read_bytes(corpus.SHIPPED[corpus.SHAKESPEARE])
    folder.mkdir()
    eighth = len(text) // 8
    for i in range(2):  # two files of the works' first quarter
        (folder / f"part{i}.txt").write_bytes(text[i * eighth : (i + 1) * eighth])


def _photos(folder: pathlib.Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import digits_folder
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    digits_folder.main(str(folder))


INPUTS = {  # what a block names -> how the test makes it
    "mytask:": lambda d: (d / "mytask.py").write_text(MYTASK),
    "mymodule:": lambda d: (d / "mymodule.py").write_text(MYMODULE),
    "my_corpus/": lambda d: _corpus(d / "my_corpus"),
    "my_photos/": lambda d: _photos(d / "my_photos"),
}


def workspace(tmp_path: pathlib.Path, code: str) -> tuple[pathlib.Path, dict, str]:
    """``(cwd, env, code)`` to run a block in: the folder, environment and rewrites the module's
    docstring lists."""
    cwd, tmp, home, shim = (tmp_path / n for n in ("work", "tmp", "home", "shim"))
    for folder in (cwd, tmp, home, shim):
        folder.mkdir()
    for name in ("configs", "scripts"):
        (cwd / name).symlink_to(ROOT / name)
    for needle, make in INPUTS.items():
        if needle in code:
            make(cwd)
    (shim / "uv").write_text('#!/bin/sh\n[ "$1" = run ] || { echo "uv $1: not shimmed" >&2; '
                             'exit 2; }\nshift\nexec "$@"\n')  # fmt: skip
    (shim / "uv").chmod(0o755)
    path = os.pathsep.join([str(shim), str(pathlib.Path(sys.executable).parent),
                            os.environ.get("PATH", "")])  # fmt: skip
    env = child_env(TQDM_DISABLE="1", PYTHONPATH=str(ROOT), HOME=str(home), PATH=path)
    return cwd, env, local(code, tmp_path)


def local(code: str, tmp_path: pathlib.Path) -> str:
    """``code`` with ``/tmp/`` turned into the test's own ``tmp/``."""
    return code.replace("/tmp/", f"{tmp_path / 'tmp'}/")


def never_syncs(out: str) -> list[str]:
    """The lines of a block's output that say a run it started never syncs."""
    return [line for line in out.splitlines() if "never syncs" in line]


# --- the inventory ----------------------------------------------------------------------------


def test_every_block_is_tagged_and_every_not_run_mark_gives_a_reason():
    known = {"python", "{include}", "json", "toml", "text", "", *SHELL}
    problems = []
    for page in PAGES:
        blocks, dangling = parse_blocks(page)
        problems += dangling
        for b in blocks:
            if b.lang not in known:
                problems.append(f"{b.where}: language {b.lang!r}: add it to this test")
            if b.not_run == "":
                problems.append(f"{b.where}: a not-run mark without its reason")
            if b.not_run is not None and b.lang not in ("python", *SHELL):
                problems.append(f"{b.where}: a not-run mark on a {b.lang or 'untagged'} block")
            if b.lang in ("", "text"):
                commands_ = [line for line in b.code.splitlines() if COMMAND_START.match(line)]
                problems += [f"{b.where}: {c.strip()!r} is a command: tag the block bash"
                             for c in commands_]  # fmt: skip
            elif b.lang == "json":
                json.loads(b.code)
            elif b.lang == "toml":
                tomllib.loads(b.code)
            elif b.lang == "{include}":
                assert included(b), f"{b.where}: the include brings no block"
    assert not problems, "\n".join(problems)
    assert len(all_blocks()) > 20, "the blocks were not found: did the fence pattern break?"


def test_the_block_scan_reads_marks_includes_and_commands(tmp_path):
    (tmp_path / "other.md").write_text("```python\nskipped()\n```\n<!-- here -->\n\n"
                                       "```python\nx = 1\n```\n<!-- /here -->\n")  # fmt: skip
    page = tmp_path / "page.md"
    page.write_text(
        textwrap.dedent("""\
        <!-- not-run: needs a cluster -->
        <!-- cluster-example -->
        ```bash
        srun uv run python -m diloco_jax.train --config tiny \\
            --workdir /tmp/r  # a comment
        ```
        <!-- not-run: -->
        ````python
        print(1)
        ````
        <!-- not-run: adrift -->

        ```{include} other.md
        :start-after: <!-- here -->
        :end-before: <!-- /here -->
        ```
        """)
    )
    blocks, problems = parse_blocks(page)
    assert [(b.line, b.lang, b.not_run, b.name) for b in blocks] == [
        (3, "bash", "needs a cluster", "cluster-example"), (8, "python", "", ""),
        (13, "{include}", None, ""),
    ]  # fmt: skip
    assert problems == ["page.md:11: a not-run mark not before a fence"]
    assert blocks[1].code == "print(1)\n"
    assert [(b.page.name, b.line, b.code) for b in included(blocks[2])] == [
        ("other.md", 6, "x = 1\n")
    ]  # fmt: skip
    assert entry_point(commands(blocks[0].code)[0]) == (
        "diloco_jax.train", ["--config", "tiny", "--workdir", "/tmp/r"]
    )  # fmt: skip
    assert entry_point(["scripts/launch_local.sh", "2", "--workdir", "w"]) == (
        "diloco_jax.launch", ["-n", "2", "--workdir", "w"]
    )  # fmt: skip
    assert commands("$ python -m sim --help\nusage: ...\n") == [["python", "-m", "sim", "--help"]]


def test_every_shell_block_is_valid_bash():
    bad = []
    for b in all_blocks():
        if b.lang in SHELL:
            code = "\n".join(c[2:] for c in b.code.splitlines() if c.startswith("$ ")) \
                if b.lang == "console" else b.code  # fmt: skip
            check = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
            if check.returncode:
                bad.append(f"{b.where}: {check.stderr.strip()}")
    assert not bad, "\n".join(bad)


# --- python blocks ----------------------------------------------------------------------------


def run_by_test_readme(block: Block) -> bool:
    """Whether tests/test_readme.py runs ``block`` on its own (it finds it by its name) and
    checks what it computes."""
    return bool(block.name) and f'"{block.name}"' in (ROOT / "tests" / "test_readme.py").read_text()


def _python_sequence(page: pathlib.Path) -> list[Block]:
    """The python blocks a reader of ``page`` runs, in order, includes expanded, but those at
    the end that tests/test_readme.py runs (nothing after them needs them)."""
    out = []
    for b in parse_blocks(page)[0]:
        for one in included(b) if b.lang == "{include}" else [b]:
            if one.lang == "python" and one.not_run is None:
                out.append(one)
    while out and run_by_test_readme(out[-1]):
        out.pop()
    return out


PYTHON_PAGES = [p for p in PAGES if _python_sequence(p)]
_RUNNER = """\
import json, sys, time
scope = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1])):
    start = time.perf_counter()
    exec(compile(block["code"], block["where"], "exec"), scope)
    print(f"--- {block['where']} ran in {time.perf_counter() - start:.1f} s", flush=True)
"""


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_pages_python_blocks_run_in_order(page, tmp_path):
    sequence = _python_sequence(page)
    cwd, env, _ = workspace(tmp_path, "")
    blocks = [{"where": b.where, "code": local(b.code, tmp_path)} for b in sequence]
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    run = subprocess.run([sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json")],
                         cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert not never_syncs(run.stdout + run.stderr), never_syncs(run.stdout + run.stderr)


def test_the_task_guides_dropout_loss_trains_and_is_evaluated(tmp_path):
    """The loss of the guide's Randomness section trains (a key per replica and step) and the
    default evaluation, which passes ``rng=None``, evaluates it."""
    import diloco_jax

    page = ROOT / "docs" / "guides" / "your_task.md"
    (block,) = [b for b in parse_blocks(page)[0] if "jax.random.bernoulli(rng" in b.code]
    scope: dict = {}
    exec(compile(block.code, block.where, "exec"), scope)  # noqa: S102
    x_NxD = np.random.default_rng(0).normal(size=(256, 3)).astype(np.float32)
    data = {"x": x_NxD, "y": x_NxD @ np.array([1.0, -2.0, 0.5], np.float32)}
    keyed = set()  # whether the loss was traced with a key: in training, and without one

    def loss(params, batch, rng):
        keyed.add(rng is not None)
        return scope["loss"](params, batch, rng)

    task = diloco_jax.ArrayTask({"w": np.zeros(3, np.float32)}, loss, data)
    result = diloco_jax.fit(task, workdir=tmp_path / "run", show_progress=False,
                            overrides={"parallel.runtime": "sim", "train.total_steps": 10,
                                       "train.checkpoint": False})  # fmt: skip
    evals = [e["eval_loss"] for e in result.history if e["event"] == "eval"]
    assert len(evals) >= 2 and all(map(math.isfinite, evals)), evals
    assert evals[-1] < evals[0]  # it trained
    assert keyed == {True, False}


# --- shell blocks -----------------------------------------------------------------------------


def _shell_blocks(pick) -> list:
    seen, out = set(), []
    for b in all_blocks():
        if b.lang in SHELL and b.not_run is None and pick(b) and b.code not in seen:
            seen.add(b.code)  # the same block on two pages runs once
            out.append(pytest.param(b, id=b.where))
    return out


def _run_shell(block: Block, tmp_path: pathlib.Path, timeout: int) -> str:
    cwd, env, code = workspace(tmp_path, block.code)
    lines = code.replace("\\\n", " ").splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    for i, line in enumerate(lines):
        e = entry_point(shlex.split(line, comments=True) if line.strip() else [])
        if e and e[0] == "diloco_jax.train" and not re.search(r"--config[ =]|--help", line):
            lines[i] = f"{line.split(' #')[0].rstrip()} {SHORTER}"  # the default preset
    run = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", "\n".join(lines)], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"{block.where} failed:\n{run.stdout[-2000:]}{run.stderr[-4000:]}"
    assert not never_syncs(out), f"{block.where}: {never_syncs(out)}"
    return out


@pytest.mark.parametrize("block", _shell_blocks(lambda b: not trains(b)))
def test_a_shell_block_runs_as_written(block, tmp_path):
    _run_shell(block, tmp_path, timeout=120)


@pytest.mark.slow  # ~5-10 min in all; the stand-in: the parse test below, for each block
@pytest.mark.parametrize("block", _shell_blocks(trains))
def test_a_training_shell_block_runs_as_written(block, tmp_path):
    _run_shell(block, tmp_path, timeout=600)


@functools.cache
def _parsers():
    import sim.__main__ as sim_main
    from diloco_jax import launch, train
    from diloco_jax.config import cli

    return cli, launch, train, sim_main


def _parse(module: str, argv: list[str]) -> list:
    """The configs the command ``python -m module *argv`` would run, from the entry point's own
    parser (SystemExit on a bad flag, ConfigError on a bad value)."""
    cli, launch, train, sim_main = _parsers()
    if module == "diloco_jax.launch":
        opts, rest = launch.parse(argv)
        return _parse(opts.module, rest) + (_parse("diloco_jax.syncer", rest)
                                            if opts.learners else [])  # fmt: skip
    if module == "diloco_jax.syncer" and argv[:1] == ["certs"]:
        return []
    extend = {"diloco_jax.train": train._train_flags, "sim": sim_main._sweep_flags}.get(module)
    args = cli.parse(argv, prog=f"python -m {module}", distributed=module == "diloco_jax.train",
                     resume=module == "diloco_jax.train", extend=extend)  # fmt: skip
    if args is None:  # --help
        return []
    if module != "sim":
        return [args.cfg]
    from sim import sweep

    f = args.flags
    plan = sweep.plan(args.cfg, f.sweep, sim_main._items("--baselines", f.baselines),
                      sim_main._seeds(f.seeds))  # fmt: skip
    return [cfg for _, _, cfg in plan]


@pytest.mark.parametrize("block", _shell_blocks(trains))
def test_the_commands_of_a_training_shell_block_parse(block, tmp_path, monkeypatch, capsys):
    from diloco_jax.config import validation

    cwd, env, code = workspace(tmp_path, block.code)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", env["HOME"])
    parsed = [e for words in commands(code) if (e := entry_point(words))]
    assert parsed, f"{block.where}: no command of an entry point found"
    for module, argv in parsed:
        if BENCH.fullmatch(module):  # its flags are its argparse's (read from its source)
            source = (ROOT / module).read_text()
            for flag in (a.split("=")[0] for a in argv if a.startswith("--")):
                assert f'"{flag}"' in source, f"{block.where}: {module} has no flag {flag}"
            continue
        if module not in TRAINING:
            continue
        try:
            configs = _parse(module, argv)
        except SystemExit as e:
            pytest.fail(f"{block.where}: {module} {argv} exits {e.code}: {capsys.readouterr().err}")
        for cfg in configs:
            notices = validation.notices(cfg)
            assert not notices, f"{block.where}: {notices}"
