"""Packaging: presets found by name or path, and a wheel that works outside the repository.

The wheel is built with uv (offline: the build backend is in uv's cache once ``uv sync`` has
run); the slow tests install it into a fresh virtual environment, the dependencies from the lock
file (``uv export --format pylock.toml``, offline from the cache), and run the console scripts
from a directory that is not the checkout.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from diloco_jax import config as config_lib
from diloco_jax.config import presets

ROOT = pathlib.Path(__file__).resolve().parent.parent
UV = os.environ.get("UV") or shutil.which("uv")  # `uv run` names itself in $UV
SCRIPTS = {
    "diloco-train",
    "diloco-sim",
    "diloco-combine",
    "diloco-prepare",
    "diloco-launch",
    "diloco-syncer",
}
needs_uv = pytest.mark.skipif(UV is None, reason="uv is not installed")


def _uv(*args: str, cwd: pathlib.Path = ROOT) -> str:
    result = subprocess.run([UV, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "UV_OFFLINE": "1"})  # fmt: skip
    assert result.returncode == 0, f"uv {' '.join(args)}:\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    _uv("build", "--wheel", "--out-dir", str(out), "--quiet")
    (path,) = out.glob("diloco_jax-*.whl")
    return path


def test_presets_are_found_by_name_or_path(tmp_path, monkeypatch):
    tiny = presets.DIRECTORY / "tiny.py"
    assert presets.find("tiny") == presets.find("tiny.py") == tiny
    assert presets.DEFAULT == config_lib.DEFAULT_PRESET == presets.DIRECTORY / "default.py"
    assert {"default", "tiny", "digits", "lm_1b"} <= set(presets.names())
    assert sorted(presets.names()) == sorted(p.stem for p in (ROOT / "configs").glob("*.py"))
    # an existing file wins over the preset of the same name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.py").write_text(
        "from diloco_jax.config import Config\n\n"
        "def get_config():\n    return Config(seed=7)\n"
    )  # fmt: skip
    assert config_lib.load_preset("tiny.py").seed == 7
    assert config_lib.load_preset(tmp_path / "tiny.py").seed == 7
    assert config_lib.load_preset("tiny") == config_lib.load_preset(tiny)
    assert config_lib.load_preset("tiny").model.d_model == 32


@pytest.mark.parametrize("preset", ["nope", "configs/tiny.py", "configs/nope.py", "tiny.txt"])
def test_unknown_preset_is_one_line_naming_the_presets(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # configs/tiny.py is a path, not a name: not found from here
    names = ", ".join(presets.names())
    with pytest.raises(config_lib.ConfigError) as error:
        config_lib.load_preset(preset)
    message = str(error.value)
    assert message.startswith(f"config preset not found: {preset} ") and "\n" not in message
    assert message.endswith(f"one of: {names})")


@needs_uv
def test_wheel_ships_presets_simulator_data_license_and_scripts(wheel):
    """Takes ~2 s (a wheel build)."""
    with zipfile.ZipFile(wheel) as archive:
        files = set(archive.namelist())
        info = f"diloco_jax-{wheel.name.split('-')[1]}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    tops = {name.split("/")[0] for name in files}
    assert tops == {"diloco_jax", info}, tops  # no top-level sim or configs
    want = {f"diloco_jax/configs/{p.name}" for p in (ROOT / "configs").glob("*.py")}
    want |= {f"diloco_jax/sim/{p.name}" for p in (ROOT / "sim").glob("*.py")}
    want |= {"diloco_jax/data/shakespeare.txt.xz", "diloco_jax/data/digits.npz",
             "diloco_jax/data/NOTICE.md", "diloco_jax/py.typed",
             f"{info}/licenses/LICENSE"}  # fmt: skip
    assert len(want) > 15 and want <= files, sorted(want - files)
    assert not [name for name in files if "__pycache__" in name or name.endswith(".pyc")]
    assert "License-Expression: Apache-2.0" in metadata
    extras = {line.split(": ")[1] for line in metadata.splitlines()
              if line.startswith("Provides-Extra: ")}  # fmt: skip
    assert extras == {"tfds", "images", "sentencepiece", "plots", "cuda12", "tensorboard",
                      "wandb", "learners", "all"}  # fmt: skip
    assert {line.split(" = ")[0] for line in entry_points.splitlines() if " = " in line} == SCRIPTS


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> pathlib.Path:
    """A fresh virtual environment with the wheel and the lock's dependencies; its bin folder."""
    where = tmp_path_factory.mktemp("installed")
    venv, lock = where / "venv", where / "pylock.toml"
    _uv("export", "--frozen", "--no-dev", "--no-emit-project", "--format", "pylock.toml",
        "--quiet", "--output-file", str(lock))  # fmt: skip
    _uv("venv", "--quiet", "--python", sys.executable, str(venv))  # this Python (3.11)
    python = str(venv / "bin" / "python")
    _uv("pip", "install", "--quiet", "--python", python, "-r", str(lock))
    _uv("pip", "install", "--quiet", "--python", python, str(wheel))  # its requirements: met
    _uv("pip", "check", "--python", python)
    return venv / "bin"


def _run(bin_dir: pathlib.Path, *args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Runs a command of the installed environment the way a user's shell would: from ``cwd``,
    nothing of the checkout on the path, one CPU device."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS")}  # fmt: skip
    env |= {"JAX_PLATFORMS": "cpu", "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow  # ~45 s: a fresh environment, then a tiny run from another directory
@needs_uv
def test_installed_wheel_trains_the_tiny_preset_from_another_directory(installed, tmp_path):
    """The default install (no extra) trains, finds its shipped data and says in one line which
    extra a TFDS corpus or a figure needs."""
    probe = ("import importlib.metadata as m, importlib.util as u, diloco_jax, diloco_jax.sim;"
             "print(diloco_jax.__file__); assert u.find_spec('sim') is None;"
             "[e.load() for e in m.entry_points(group='console_scripts') if e.dist.name == "
             "'diloco-jax']; from diloco_jax.data.images import load_digits;"
             "assert load_digits()[0].shape == (1797, 8, 8); missing = [n for n in ("
             "'tensorflow_datasets', 'grain', 'PIL', 'sentencepiece', 'matplotlib', 'sklearn',"
             "'wandb') if u.find_spec(n)]; assert not missing, missing")  # fmt: skip
    found = _run(installed, "python", "-c", probe, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert str(installed.parent) in found.stdout and str(ROOT) not in found.stdout

    tfds = _run(installed, "diloco-train", "--workdir", "r", "--config.data.corpus=tfds:mnist",
                cwd=tmp_path)  # fmt: skip
    assert tfds.returncode == 2 and not (tmp_path / "r").exists()
    assert tfds.stderr.splitlines() == [
        "error: config key data.corpus = 'tfds:mnist' needs TensorFlow Datasets: "
        "pip install 'CLONE[tfds]' (CLONE: your clone of diloco-jax)"
    ]
    combine = _run(installed, "diloco-combine", "sweep", "--out", "c", cwd=tmp_path)
    assert combine.returncode == 2 and not (tmp_path / "c").exists()
    assert combine.stderr.splitlines() == [
        "error: drawing tradeoff.png needs matplotlib: pip install 'CLONE[plots]' (CLONE: your "
        "clone of diloco-jax)"
    ]

    shown = _run(installed, "diloco-train", "--help", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    words = " ".join(shown.stdout.split())  # argparse wraps the preset list where it likes
    assert "usage: diloco-train" in words and ", ".join(presets.names()) in words

    flags = ["--workdir", "run", "--config.train.total_steps=10", "--config.train.sample_chars=0"]
    done = _run(installed, "diloco-train", "--config", "tiny", *flags, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final eval loss" in done.stdout
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert events[-1]["event"] == "done" and events[-1]["step"] == 10
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["d_model"] == 32


@pytest.mark.slow  # ~60 s: two processes of the tiny run
@needs_uv
def test_installed_launcher_starts_the_installed_trainer(installed, tmp_path):
    flags = ["--config", "tiny", "--workdir", "run", "--config.train.total_steps=10",
             "--config.train.sample_chars=0"]  # fmt: skip
    done = _run(installed, "diloco-launch", "-n", "2", "--", *flags, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final eval loss" in done.stdout
    assert (tmp_path / "run" / "params").is_dir()
