"""The persistent compilation cache (issue 28): where it lives, off when asked, and a second
identical command loading its step from it and training the same parameters."""

import os
import pathlib
import subprocess
import sys

from diloco_jax.runtime import compile_cache
from tests.test_checkpoint import assert_bitwise_equal, events

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_off_turns_the_cache_off_and_a_directory_turns_it_on(tmp_path):
    import jax

    try:
        assert compile_cache.enable("off") is None
        assert not jax.config.jax_enable_compilation_cache
        assert compile_cache.enable(str(tmp_path / "c")) == tmp_path / "c"
        assert jax.config.jax_enable_compilation_cache and (tmp_path / "c").is_dir()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    finally:
        compile_cache.enable()  # back to the suite's own (conftest)


def test_the_directory_is_the_key_else_the_variable_else_the_user_cache(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert compile_cache.directory("", env) == tmp_path / "xdg" / "diloco_jax" / "xla"
    env[compile_cache.ENV] = str(tmp_path / "from_env")
    assert compile_cache.directory("", env) == tmp_path / "from_env"
    assert compile_cache.directory(str(tmp_path / "key"), env) == tmp_path / "key"
    assert compile_cache.directory("off", env) is None
    assert compile_cache.directory("", {compile_cache.ENV: "off"}) is None
    home = compile_cache.directory("", {})
    assert home == pathlib.Path.home() / ".cache" / "diloco_jax" / "xla"


def _train(workdir, cache, *overrides):
    env = {**os.environ, "TQDM_DISABLE": "1", compile_cache.ENV: str(cache)}
    run = subprocess.run([sys.executable, "-m", "diloco_jax.train", "--config", "tiny",
                          "--workdir", str(workdir), "--config.train.sample_chars=0",
                          "--config.train.total_steps=10", "--config.parallel.runtime=sim",
                          *overrides],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr


def test_a_second_identical_command_loads_its_step_from_the_cache(tmp_path):
    from diloco_jax.runtime import checkpoint
    from diloco_jax.tasks import model as model_lib

    cache = tmp_path / "cache"
    first = _train(tmp_path / "a", cache)
    assert "compiled in" in first and "loaded from the compilation cache" not in first
    assert any(cache.iterdir())
    second = _train(tmp_path / "b", cache)
    assert "loaded from the compilation cache in" in second
    _, like = model_lib.init_model(0, vocab_size=256, seq_len=32, d_model=32, num_layers=1,
                                   num_heads=2, mlp_ratio=2)  # fmt: skip
    a, b = (checkpoint.load_params(tmp_path / x / "params", like) for x in "ab")
    assert_bitwise_equal(a, b)


def test_runs_that_differ_only_in_seed_or_outer_lr_share_one_compiled_step(tmp_path):
    """The seed and a constant outer learning rate are inputs of the compiled step, not
    constants in it (``StepControl.seed``, :func:`diloco_jax.recipe.outer_lr_input`): a sweep
    over them compiles once. The inner learning rate is a constant of the step (its schedule),
    so changing it compiles anew, and the log says so although the evaluation, compiled
    alongside the step in another thread, comes from the cache."""
    cache = tmp_path / "cache"
    assert "compiled in" in _train(tmp_path / "a", cache)
    other = _train(tmp_path / "b", cache, "--config.seed=1", "--config.outer.learning_rate=0.5")
    assert "loaded from the compilation cache in" in other
    inner = _train(tmp_path / "c", cache, "--config.inner.learning_rate=1e-3")
    assert "compiled in" in inner and "loaded from the compilation cache" not in inner
    done = {x: events(tmp_path / x)[-1] for x in "abc"}  # the summaries say it too
    assert [done[x]["step_from_cache"] for x in "abc"] == [False, True, False]
