"""Malformed command lines through every entry point (train, sim, combine, prepare, launch): each
must exit with status 2 and one line ``error: ...`` on stderr, no traceback, before anything is
loaded, compiled, started or written.

Each case is a valid command line with one bad fragment put in at a seeded random place (the
valid flags in a seeded random order), so every case is malformed and the set is the same on
every run. The cases run in-process (``main(argv)``); what would do real work (training, data
loading, joining a cluster, starting processes, writing a dataset or a table) is replaced by a
stub that fails the test. One case per entry point also runs as ``python -m ...``.
"""

from __future__ import annotations

import math
import pathlib
import random
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NEEDS_VALUE = {"--workdir", "--config", "--sweep", "--seeds", "--baselines", "--text", "--out",
               "--title", "--val_fraction", "-n", "--grace"}  # fmt: skip

# the bad fragments; "{F}" is an existing file, "{T}" the temporary directory
CONFIG_BAD = [
    ["--config.bogus.key=1"], ["--config.outer.sync_evry=5"], ["--config.outer.sync_every=0"],
    ["--config.outer.sync_every=x"], ["--config.outer.sync_every="],
    ["--config.inner.learning_rate=nan"], ["--config.inner.learning_rate=-1"],
    ["--config.outer.learning_rate=inf"], ["--config.inner.b1=1"], ["--config.inner.b2=-0.1"],
    ["--config.algorithm=adam"], ["--config.parallel.runtime=gpu"], ["--config.seed=-1"],
    ["--config.seed=1.5"], ["--config.train.checkpoint=maybe"], ["--config.compress.codec=zip"],
    ["--config.sim.speeds=1,x"], ["--config.data.val_fraction=1"], ["--config.model.dropout=1"],
    ["--config.parallel.replicas=-4"], ["--config.train.total_steps=1e3"],
    ["--config.sim.drop=9:0-1"], ["--config.outer.mode=async"], ["--config.streaming.fragments=0"],
    ["--config.train.checkpoint_every=7"], ["--config.ünïcode=1"], ["--config", "nosuchpreset"],
    ["--config", ""], ["--config", "{F}"], ["--workdir", "{F}/run"], ["--workdir", "{F}"],
    ["--workdir", ""], ["--bogus", "1"], ["positional"], ["-x"], ["--"], ["--workdir"],
    ["--config"],
]  # fmt: skip
TRAIN_BAD = CONFIG_BAD + [
    ["--num_processes", "x"], ["--num_processes", "2"], ["--distributed", "maybe"],
    ["--process_id", "-1", "--num_processes", "2", "--coordinator_address", "127.0.0.1:1"],
    ["--coordinator_address", "nohost", "--num_processes", "2", "--process_id", "0"],
    ["--init_timeout", "soon"], ["--allow_config_change=perhaps"],
]  # fmt: skip
SIM_BAD = CONFIG_BAD + [
    ["--sweep", "outer.sync_every=,"], ["--sweep", "outer.sync_every="], ["--sweep", "=1,2"],
    ["--sweep", "bogus.key=1"], ["--sweep", "outer.sync_every"], ["--sweep", ""],
    ["--sweep", "outer.sync_every=1,1"], ["--sweep", "outer.sync_every=0,5"],
    ["--sweep", "outer.sync_every=5", "--sweep", "outer.sync_every=10"],
    ["--sweep", "sim.speeds=[1,1"], ["--sweep", "sim.speeds=[1,0.5]"], ["--sweep", "seed=1,2"],
    ["--seeds", "0,x"], ["--seeds", "0,,1"], ["--seeds", ""], ["--seeds", "-1"],
    ["--seeds", "2147483648"], ["--seeds", "1,1"], ["--baselines", "adam"], ["--baselines", ","],
    ["--baselines", "ddp,ddp"], ["--num_processes", "2"], ["--sweep"], ["--seeds"],
]  # fmt: skip
PREPARE_BAD = [
    ["--text", "{T}/missing.txt"], ["--images", "{T}"], ["--out", "{F}/x"], ["--out", "{F}"],
    ["--out", ""], ["--val_fraction", "1"], ["--val_fraction", "x"], ["--val_fraction", "nan"],
    ["--val_fraction", "-0.1"], ["--tokenizer", "bpe"], ["--vocab_size", "x"],
    ["--vocab_size", "1"], ["--record_tokens", "0"], ["--size", "3"], ["--name", "Bad-Name"],
    ["--name", "ünï"], ["--bogus"], ["positional"], ["--text"], ["--out"],
]  # fmt: skip
COMBINE_BAD = [
    ["--out", "{F}/x"], ["--out", "{F}"], ["--out", ""], ["{T}/missing_sweep"], ["{F}"],
    ["{T}/badcsv"], ["--bogus"], ["-x"], ["--out={F}/y"], ["--out"], ["--replot", "{T}"],
    ["--replot", "{T}/missing"], ["--title"], ["--title="],
]  # fmt: skip
COMBINE_BAD = COMBINE_BAD[:-1]  # an empty title is a title
LAUNCH_BAD = [
    ["-n", "x"], ["-n", "0"], ["-n", "-2"], ["-n", "1.5"], ["-n", ""], ["--num_processes=two"],
    ["--grace", "abc"], ["--grace", "-1"], ["--grace", "nan"], ["--grace", "inf"],
    ["--port", "-1"], ["--port", "70000"], ["--port", "x"], ["--devices_per_process", "0"],
    ["--devices_per_process", "y"], ["--module", ""], ["--module", "no such"], ["-n"], ["--grace"],
    ["--learners", "-1"], ["--learners", "x"], ["--max_restarts", "-1"], ["--learners", "2"],
    ["--learners", "2", "-n", "1"],  # no --workdir
]  # fmt: skip

BASES = {
    "train": [["--config", "tiny"], ["--workdir", "{T}/run"],
              ["--config.train.total_steps=10"]],
    "sim": [["--config", "tiny"], ["--workdir", "{T}/sweep"],
            ["--sweep", "outer.sync_every=5,10"], ["--seeds", "0,1"]],
    "prepare": [["--text", "{T}/corpus.txt"], ["--out", "{T}/data"], ["--name", "mine"]],
    "combine": [["{T}/sweep_ok"], ["--out", "{T}/combined"]],
    "launch": [["-n", "2"], ["--grace", "1"], ["--devices_per_process", "1"]],
}  # fmt: skip
BAD = {
    "train": TRAIN_BAD,
    "sim": SIM_BAD,
    "prepare": PREPARE_BAD,
    "combine": COMBINE_BAD,
    "launch": LAUNCH_BAD + [[]],
}  # fmt: skip; [] with -n dropped: no -n


def _flag(arg: str) -> str:
    return arg.partition("=")[0]


def cases(entry: str, minimum: int = 50) -> list[list[str]]:
    """Every bad fragment of ``entry`` in at least two (and together ``minimum``) command lines:
    the base's groups in a random order, without the flags the fragment sets, the fragment at a
    random place (last when it is a flag that lacks its value)."""
    rng = random.Random(f"fuzz-{entry}")
    bad = BAD[entry]
    out = []
    for fragment in bad:
        for _ in range(max(2, math.ceil(minimum / len(bad)))):
            dropped = {_flag(a) for a in fragment if a.startswith("-")} or {"-n"}
            groups = [g for g in BASES[entry] if _flag(g[0]) not in dropped]
            if entry == "combine" and fragment and not fragment[0].startswith("-"):
                groups = [g for g in groups if g[0].startswith("-")]  # a bad sweep dir instead
            rng.shuffle(groups)
            last = fragment and fragment[-1] in NEEDS_VALUE and len(fragment) == 1
            at = len(groups) if last else rng.randint(0, len(groups))
            argv = (
                [a for g in groups[:at] for a in g] + fragment + [a for g in groups[at:] for a in g]
            )
            if entry == "launch":
                argv += ["--", "--config", "tiny"]
            out.append(argv)
    assert len(out) >= minimum
    return out


def _entry(entry: str):
    if entry == "train":
        from diloco_jax.train import main
    elif entry == "sim":
        from sim.__main__ import main
    elif entry == "combine":
        from sim.combine import main
    elif entry == "prepare":
        from diloco_jax.data.prepare import main
    else:
        from diloco_jax.launch import main
    return main


def _files(root: pathlib.Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A temporary directory (the working directory) with an existing file, a text file, a
    sweep's summary.csv and a bad one."""
    from sim import combine

    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "corpus.txt").write_text("some text " * 100)
    (tmp_path / "sweep_ok").mkdir()
    head = ["run", "codec", *combine.NUMBERS]
    (tmp_path / "sweep_ok" / "summary.csv").write_text(
        ",".join(head) + "\n" + ",".join(["diloco", "none", *["1"] * len(combine.NUMBERS)]) + "\n"
    )
    (tmp_path / "badcsv").mkdir()
    (tmp_path / "badcsv" / "summary.csv").write_text("run,codec\nx,none\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_work(monkeypatch):
    """Everything that would do real work fails the test."""
    from diloco_jax import launch

    def reached(*args, **kwargs):
        raise AssertionError("a malformed command line got past validation")

    stubs = ("diloco_jax.train.train", "diloco_jax.run.distributed._join",
             "diloco_jax.config.problems.load",
             "sim.sweep.run_one", "diloco_jax.data.prepare._prepare", "sim.combine.table",
             "sim.plots.tradeoff_two_panels")  # fmt: skip
    for target in stubs:
        monkeypatch.setattr(target, reached)
    monkeypatch.setattr(launch, "subprocess", types.SimpleNamespace(Popen=reached))


def _fill(argv: list[str], root: pathlib.Path) -> list[str]:
    return [a.replace("{F}", str(root / "afile")).replace("{T}", str(root)) for a in argv]


@pytest.mark.parametrize("entry", list(BAD))
def test_malformed_command_lines_fail_in_one_line(entry, world, no_work, capsys):
    main = _entry(entry)
    before = _files(world)
    failures = []
    for argv in cases(entry):
        argv = _fill(argv, world)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except Exception as e:  # noqa: BLE001 - every case is reported, not only the first
            code = f"{type(e).__name__}: {e}"
        out, err = capsys.readouterr()
        lines = err.splitlines()
        ok = (code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and not out
              and len(lines[0]) > len("error: ") and "Traceback" not in err)  # fmt: skip
        if not ok or _files(world) != before:
            failures.append(f"{argv}: exit {code}, stderr {err!r}, stdout {out[:200]!r}")
    assert not failures, "\n".join(failures)


SUBPROCESS = {
    "diloco_jax.train": ["--config", "tiny", "--workdir", "{F}/run"],
    "sim": ["--config", "tiny", "--workdir", "{T}/sweep", "--sweep", "outer.sync_every=,"],
    "sim.combine": ["{T}/sweep_ok", "--out", "{F}/out"],
    "diloco_jax.data.prepare": ["--text", "{T}/corpus.txt", "--out", "{T}/d",
                                "--val_fraction", "2"],
    "diloco_jax.launch": ["-n", "0", "--", "--config", "tiny"],
}  # fmt: skip


@pytest.mark.parametrize(
    "module",
    [
        pytest.param(m, marks=[] if m == "diloco_jax.train" else pytest.mark.slow)
        for m in SUBPROCESS
    ],
)
def test_python_dash_m_fails_in_one_line(module, world):
    """The real ``python -m`` path (slow but train's: each start imports JAX, seconds)."""
    before = _files(world)
    result = subprocess.run([sys.executable, "-m", module, *_fill(SUBPROCESS[module], world)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not result.stdout
    assert _files(world) == before
