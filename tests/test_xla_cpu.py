"""The XLA:CPU options of the training calls: what they change in the compiled program, that
they are scoped to our calls, and that they never break a run."""

import logging
import re

import chex
import jax
import jax.numpy as jnp
from jax import lax

from diloco_jax.runtime import xla_cpu


def _replica_sum_hlo(options: dict) -> str:
    """The optimized HLO of a sum over a vmapped replica axis: what every simulator sync does."""
    summed = jax.vmap(lambda x: lax.psum(x, "r"), axis_name="r")
    x = jnp.ones((8, 64, 32))
    return jax.jit(summed, compiler_options=options).lower(x).compile().as_text()


def _library_reductions(hlo: str) -> int:
    """How many YNNPACK library fusions of the module hold a reduce."""
    bodies = dict(re.findall(r"^%?([\w.\-]+) \(.*?\{\n(.*?)\n\}", hlo, re.S | re.M))
    called = re.findall(r"calls=%([\w.\-]+).*__ynn_fusion", hlo)
    return sum(" reduce(" in bodies.get(name, "") for name in called)


def test_options_keep_the_replica_reduction_out_of_library_fusions():
    """XLA's defaults put the replica sum in a YNNPACK fusion (the slow path); the options keep
    it in XLA's own loops. The first assertion keeps this test from passing vacuously on a
    jaxlib that no longer does either."""
    assert _library_reductions(_replica_sum_hlo({})) >= 1
    options = xla_cpu.compiler_options("cpu")
    assert options == xla_cpu.OPTIONS
    assert _library_reductions(_replica_sum_hlo(options)) == 0


def test_options_change_no_result():
    x = jax.random.normal(jax.random.key(0), (8, 64, 32))
    summed = jax.vmap(lambda v: lax.psum(v, "r"), axis_name="r")
    plain = jax.jit(summed)(x)
    tuned = jax.jit(summed, compiler_options=xla_cpu.compiler_options("cpu"))(x)
    chex.assert_trees_all_close(tuned, plain, rtol=1e-6, atol=1e-6)


def test_options_are_off_elsewhere_and_when_asked(monkeypatch):
    assert xla_cpu.compiler_options("gpu") == {}
    monkeypatch.setenv(xla_cpu.ENV, "0")
    assert xla_cpu.compiler_options("cpu") == {}


def test_an_option_this_jaxlib_does_not_know_is_dropped_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(xla_cpu, "OPTIONS", {"xla_cpu_no_such_option_anywhere": "1"})
    with caplog.at_level(logging.WARNING, logger="diloco_jax"):
        assert xla_cpu.compiler_options("cpu") == {}
    assert "not accepted" in caplog.text
