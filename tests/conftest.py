"""Test setup: 8 fake CPU devices so the mesh runtime can be checked against the simulator, and
no cluster: the tests run alike inside a SLURM allocation or an MPI job."""

import atexit
import os
import re
import shutil
import tempfile

SUITE_XLA_OPT = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# a user's own XLA_FLAGS are kept, but for the device count the mesh tests need
_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
# The suite's programs are tiny: compiling them is most of its time, and LLVM's optimisation
# passes most of that (-O0 took a third off two layout tests, docs/testing.md). Every program
# of a test, and of the commands it runs in child processes, compiles alike, so two layouts
# are compared under one compiler; DILOCO_TEST_XLA_OPT=default keeps XLA's own level.
if os.environ.get("DILOCO_TEST_XLA_OPT", "0") != "default" and "optimization_level" not in _flags:
    _flags += f" {SUITE_XLA_OPT}"
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.pop("JAX_NUM_CPU_DEVICES", None)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] != "cpu":  # a part of the suite on a GPU (scripts/gpu_check.sh):
    # fp32 matmuls in fp32 (a GPU's default, TF32, keeps 10 bits of mantissa: the equivalence
    # tests' tolerances are for float32); deterministic ops: below, as train() asks for them
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
for _name in [n for n in os.environ if n.startswith(("SLURM_", "OMPI_", "PMI_"))]:
    del os.environ[_name]  # JAX would join that cluster, and train refuses a multi-task salloc
# One compilation cache for the session, fresh each time: a program compiled by one test (the
# tiny preset's step, say) is loaded by the next test and by the commands tests run in child
# processes, instead of compiled again. JAX keys each entry by the program, its options and the
# versions, so a test gets the executable it would have compiled. DILOCO_COMPILE_CACHE=off
# (or a directory) set before pytest wins.
# Every program, however small: the eager operations of test code and of each command's set-up
# (tens of milliseconds each to compile, hundreds of them per process) are read back by the
# suite's other processes instead (a test ran in 13.9 s instead of 17.2 s after another had).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if "DILOCO_COMPILE_CACHE" not in os.environ:
    os.environ["DILOCO_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="diloco_tests_xla_")
    atexit.register(shutil.rmtree, os.environ["DILOCO_COMPILE_CACHE"], ignore_errors=True)

from diloco_jax.runtime import compile_cache, parallel  # noqa: E402  (after the environment)
from tests import helpers  # noqa: E402

compile_cache.enable()  # for the tests that compile through the library, not train()
parallel.deterministic_gpu(True)  # equal bits run to run on a GPU; nothing under JAX_PLATFORMS=cpu


# Figures only where a test looks at them (helpers.drawing_figures()): matplotlib's drawing
# runs on the cores the other tests need.
helpers.no_figures()

# The heaviest files first: with a file to a worker, a long file handed out last keeps one core
# busy while the other has finished (about 40 s of a 10-minute run). The rest keep their order.
HEAVY_FIRST = ("test_program_cache", "test_checkpoint", "test_user_task", "test_compress",
               "test_multiprocess", "test_grain_task", "test_sim", "test_quorum", "test_outer",
               "test_variants", "test_noloco", "test_tfds_images", "test_memory")  # fmt: skip


def pytest_collection_modifyitems(items):
    def rank(item):
        stem = item.path.stem
        return HEAVY_FIRST.index(stem) if stem in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=rank)  # stable: a file's own tests keep their order
