"""The persistent compilation cache (issue 28): where it lives, off when asked, and a second
identical command loading its step from it and training the same parameters."""

import os
import pathlib
import subprocess
import sys

import pytest

from diloco_jax.runtime import compile_cache
from tests.helpers import events
from tests.test_checkpoint import assert_bitwise_equal

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


@pytest.mark.slow  # ~50 s: three commands; stand-ins: test_program_cache's in-process mesh run
# (a kept program loaded, the same bits as no cache), the per-thread hit count below and the
# cache's directory tests above
def test_warm_commands_load_their_step_and_train_what_an_uncached_command_trains(tmp_path):
    """Three commands on one cache. The first compiles its step and keeps its traced program.
    The second differs only in the seed and a constant outer learning rate, inputs of the
    compiled step (``StepControl.seed``, :func:`diloco_jax.config.recipe.outer_lr_input`), so a
    sweep over them compiles once: it loads both and trains the bits that the same command trains
    with no cache (the step traced and compiled by JAX alone). The inner learning rate is a
    constant of the step (its schedule): changing it compiles anew
    (tests/test_program_cache.py; the hits of the evaluation, compiled alongside the step in
    another thread, are counted there: the test below; the mesh's warm command:
    tests/test_program_cache.py)."""
    from diloco_jax.runtime import checkpoint
    from diloco_jax.tasks import model as model_lib

    cache, other = tmp_path / "cache", ["--config.seed=1", "--config.outer.learning_rate=0.5"]
    first = _train(tmp_path / "a", cache)
    assert "compiled in" in first and "loaded from the compilation cache" not in first
    assert len(list((cache / compile_cache.PROGRAMS).iterdir())) == 1
    second = _train(tmp_path / "b", cache, *other)
    assert "loaded from the compilation cache in" in second
    assert "its kept traced program reused" in second
    plain = _train(tmp_path / "plain", "off", *other)
    assert "traced program reused" not in plain
    _, like = model_lib.init_model(0, vocab_size=256, seq_len=32, d_model=32, num_layers=1,
                                   num_heads=2, mlp_ratio=2)  # fmt: skip
    b, want = (checkpoint.load_params(tmp_path / x / "params", like) for x in ("b", "plain"))
    assert_bitwise_equal(b, want)
    done = {x: events(tmp_path / x)[-1] for x in ("a", "b", "plain")}  # the summaries too
    assert [done[x]["step_from_cache"] for x in ("a", "b", "plain")] == [False, True, False]
    losses = [done[x]["final_eval_loss"] for x in ("a", "b", "plain")]
    assert losses[0] != losses[1] == losses[2]  # the seed is an input, not a constant


def test_a_load_is_counted_on_the_thread_that_loads():
    """The evaluation compiles in another thread while the step compiles
    (``run.loop._compile_ahead``): a hit there must not make a compiled step look loaded. The
    session's cache (tests/conftest.py) keeps every program."""
    import threading

    import jax
    import jax.numpy as jnp

    x_N = jnp.arange(7.0)
    jax.jit(lambda x: x * 3.0 - 11.0)(x_N)  # compiled (or loaded) here and kept in the cache
    jax.clear_caches()  # only the persistent cache has it now
    before, seen = compile_cache.hits(), {}

    def other():
        seen["before"] = compile_cache.hits()
        jax.jit(lambda x: x * 3.0 - 11.0)(x_N)
        seen["after"] = compile_cache.hits()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen["after"] == seen["before"] + 1  # loaded there, and counted there
    assert compile_cache.hits() == before  # not here


def test_an_executable_read_again_comes_from_memory_and_a_changed_program_does_not():
    """A program read back from the cache once is kept in this process: with its file gone,
    a second read still finds it (a sweep's runs read each executable once). A program that
    differs by a constant is not served the kept one."""
    import jax
    import jax.numpy as jnp

    cache = pathlib.Path(jax.config.jax_compilation_cache_dir)  # the session's (conftest)
    x_N = jnp.arange(5.0)
    files = set(cache.rglob("*"))
    jax.jit(lambda x: x * 5.0 - 2.0)(x_N)  # compiled and written
    jax.clear_caches()
    before = compile_cache.hits()
    jax.jit(lambda x: x * 5.0 - 2.0)(x_N)  # read from its file
    assert compile_cache.hits() == before + 1
    written = [f for f in set(cache.rglob("*")) - files if f.is_file()]
    assert written  # the program's entry
    for entry in written:
        entry.unlink()
    jax.clear_caches()
    again = jax.jit(lambda x: x * 5.0 - 2.0)(x_N)  # the file is gone: from memory
    assert compile_cache.hits() == before + 2
    assert again.tolist() == [-2.0, 3.0, 8.0, 13.0, 18.0]
    other = jax.jit(lambda x: x * 5.0 - 3.0)(x_N)  # another program: compiled
    assert compile_cache.hits() == before + 2
    assert other.tolist() == [-3.0, 2.0, 7.0, 12.0, 17.0]


def test_kept_executables_follow_both_signatures_of_jaxs_cache_read():
    """The in-memory layer over JAX's persistent-cache read works with the 4-argument read of
    JAX 0.10 and the 5-argument one of later JAX (host callbacks): a second read of the same key
    and devices comes from memory; a read with host callbacks always goes to JAX."""
    import types

    calls = []

    def read4(cache_key, compile_options, backend, executable_devices):
        calls.append(cache_key)
        return (f"exe-{cache_key}", 7)

    def read5(cache_key, compile_options, backend, executable_devices, host_callbacks=()):
        calls.append(cache_key)
        return (f"exe-{cache_key}-{len(host_callbacks)}", 7)

    devices = [types.SimpleNamespace(id=0)]
    backend = object()
    with compile_cache._loaded_lock:
        compile_cache._loaded.clear()
    four = compile_cache.remembering(read4)
    assert four("k4", None, backend, devices) == ("exe-k4", 7)
    assert four("k4", None, backend, devices) == ("exe-k4", 7)
    assert calls == ["k4"]
    five = compile_cache.remembering(read5)
    assert five("k5", None, backend, devices, ()) == ("exe-k5-0", 7)
    assert five("k5", None, backend, devices) == ("exe-k5-0", 7)
    assert calls == ["k4", "k5"]
    assert five("k5", None, backend, devices, [print]) == ("exe-k5-1", 7)
    assert five("k5", None, backend, devices, host_callbacks=[print]) == ("exe-k5-1", 7)
    assert calls == ["k4", "k5", "k5", "k5"]
    with compile_cache._loaded_lock:
        compile_cache._loaded.clear()
