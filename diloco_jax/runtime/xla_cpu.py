"""XLA:CPU compiler options for the compiled training calls (scoped to them, not global).

jaxlib 0.10's XLA:CPU hands reductions to YNNPACK library fusions, which sum a small leading
axis of a large array 20-30x slower than XLA's own loops (``[16, 512, 128].sum(0)``: 4.6 ms
against 0.15 ms on the 2-core development VM). That is exactly the reduction over replicas that
a ``psum``/``pmean`` under ``vmap`` becomes, so every simulator sync paid it. Keeping YNNPACK
for individual matmuls only removes it (``scripts/profile_step.py``; numbers in
docs/benchmarks.md).

The options go to ``jax.jit(..., compiler_options=...)`` of the training step only, so nothing
else in the process (a user's own programs) changes. Set ``DILOCO_XLA_CPU_OPTIONS=0`` to compile
with XLA's defaults. A jaxlib that does not know an option (a later version may rename it) gets
none of them and a warning, never an error.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp

OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
ENV = "DILOCO_XLA_CPU_OPTIONS"


@functools.cache
def _accepted(items: tuple) -> bool:
    """Whether this jaxlib compiles with ``items`` (a tiny probe, compiled once per process)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(items)).lower(jnp.zeros(2)).compile()
    except Exception as e:  # an unknown option or value: XLA's error type varies by version
        logging.getLogger("diloco_jax").warning(
            "XLA:CPU options %s not accepted by jaxlib %s (%s); compiling with the defaults",
            dict(items), jax.__version__, str(e).splitlines()[0][:120],
        )  # fmt: skip
        return False
    return True


def compiler_options(platform: str | None = None) -> dict[str, str]:
    """The options for a training call compiled for ``platform`` (default: JAX's default
    backend): :data:`OPTIONS` on CPU unless ``DILOCO_XLA_CPU_OPTIONS=0``, else none."""
    platform = platform or jax.default_backend()
    if platform != "cpu" or os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no"):
        return {}
    return dict(OPTIONS) if _accepted(tuple(sorted(OPTIONS.items()))) else {}
