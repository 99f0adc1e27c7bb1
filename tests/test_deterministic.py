"""``train.deterministic``: XLA asked for GPU programs with equal bits run to run, before JAX
starts. On an H200 the same run twice differed from its first steps without it and was equal to
the bit with it (``scripts/gpu_check.sh``, ``docs/benchmarks.md``); here, without a GPU, the flag's
handling is checked, and that a CPU-only JAX accepts it."""

import os
import subprocess
import sys

import pytest

from diloco_jax.runtime import parallel

FLAG = "--xla_gpu_deterministic_ops"


@pytest.fixture
def not_started(monkeypatch):
    monkeypatch.setattr(parallel, "_backends_started", lambda: False)


@pytest.mark.parametrize(
    "environ, enabled, expected, flags_after",
    [
        ({"XLA_FLAGS": "--xla_dump_to=/tmp/x"}, True, True, f"--xla_dump_to=/tmp/x {FLAG}=true"),
        ({}, True, True, f"{FLAG}=true"),
        ({}, False, False, None),  # asked for nothing: nothing added
        ({"JAX_PLATFORMS": "cpu"}, True, False, None),  # CPU programs are deterministic anyway
        ({"XLA_FLAGS": f"{FLAG}=false"}, True, False, f"{FLAG}=false"),  # the user's own wins
        ({"XLA_FLAGS": f"{FLAG}=true"}, False, True, f"{FLAG}=true"),
        ({"XLA_FLAGS": f"{FLAG}"}, False, True, f"{FLAG}"),
    ],
)
def test_the_flag_goes_into_xla_flags_unless_the_user_set_it(
    not_started, environ, enabled, expected, flags_after
):
    assert parallel.deterministic_gpu(enabled, environ=environ) is expected
    assert environ.get("XLA_FLAGS") == flags_after


def test_after_jax_started_it_is_too_late_and_says_so():
    parallel.jax.devices()  # JAX runs: flags are read once, when it starts
    environ = {"XLA_FLAGS": ""}
    assert parallel.deterministic_gpu(True, environ=environ) is None
    assert environ == {"XLA_FLAGS": ""}
    assert parallel.deterministic_gpu(False, environ=environ) is False


CHILD = """
import os
from diloco_jax.runtime import parallel
assert parallel.deterministic_gpu(True) is True
import jax.numpy as jnp
print(float(jnp.arange(4.0).sum()), os.environ["XLA_FLAGS"])
"""


def test_a_cpu_only_jax_starts_with_the_flag():
    """Where JAX_PLATFORMS is unset (a user's laptop), the flag is added; XLA's CPU client must
    accept it (an unknown flag would abort the process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["6.0", f"{FLAG}=true"]
