"""Streamed training data (issue 14): a text file larger than ``data.max_memory_mib`` is
memory-mapped and read call by call, never loaded, and trains exactly what the loaded file
trains, on the simulator and on the mesh, resumed or not."""

import lzma
import pathlib

import chex
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.base.axes import DATA, REPLICA
from diloco_jax.data import DataError
from diloco_jax.data.corpus import sample_batch
from diloco_jax.data.sources import load_corpus
from diloco_jax.data.stream import StreamedShards, map_text
from diloco_jax.train import train
from tests import helpers
from tests.test_train import tiny

SHAKESPEARE = pathlib.Path(__file__).parent.parent / "diloco_jax/data/shakespeare.txt.xz"
BUDGET_MIB = 0.1  # the file below is 3x this: it may not be loaded


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("corpus") / "big.txt"
    with lzma.open(SHAKESPEARE) as f:
        path.write_bytes(f.read(300_000))
    return path


def test_a_file_over_the_budget_is_mapped_not_read(text_file):
    mapped = load_corpus(str(text_file), val_fraction=0.05, max_bytes=int(BUDGET_MIB * 2**20))
    loaded = load_corpus(str(text_file), val_fraction=0.05)
    assert isinstance(mapped.train_N, np.memmap) and not isinstance(loaded.train_N, np.memmap)
    np.testing.assert_array_equal(mapped.train_N, loaded.train_N)
    np.testing.assert_array_equal(mapped.val_M, loaded.val_M)


def test_host_batches_equal_the_device_sampler(text_file):
    shards_RxS = map_text(text_file)[: 4 * 50_000].reshape(4, 50_000)
    stream = StreamedShards(shards_RxS, seed=7, batch_size=3, seq_len=16, num_steps=5)
    got = stream.batches(10, range(1, 4))  # steps 10..14, replicas 1..3
    for n in range(5):
        for i, r in enumerate(range(1, 4)):
            want = sample_batch(np.asarray(shards_RxS[r]), seed=7, replica=np.int32(r),
                                step=np.int32(10 + n), batch_size=3, seq_len=16)  # fmt: skip
            np.testing.assert_array_equal(got[n, i], want)


def _cfg(text_file, budget, **overrides):
    return tiny(**{"data.corpus": str(text_file), "data.max_memory_mib": budget,
                   "train.sample_chars": 0, **overrides})  # fmt: skip


def test_on_devices_reads_each_devices_replicas(text_file):
    shards_RxS = map_text(text_file)[: 4 * 50_000].reshape(4, 50_000)
    stream = StreamedShards(shards_RxS, seed=3, batch_size=2, seq_len=8, num_steps=3)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), (REPLICA, DATA))
    got = stream.on_devices(6, NamedSharding(mesh, P(None, REPLICA)))
    want = stream.batches(6, range(4))
    np.testing.assert_array_equal(np.asarray(got), want)
    for shard in got.addressable_shards:  # a device holds its own replicas' windows only
        replicas = range(*shard.index[1].indices(4))
        np.testing.assert_array_equal(
            np.asarray(shard.data), want[:, replicas.start : replicas.stop]
        )


@pytest.mark.slow  # ~25 s: three runs; by default test_host_batches_equal_the_device_sampler (the
# windows) and test_grain_task's test_fit_on_a_pipeline_learns_and_resumes_bitwise (the loop's
# streamed path, resumed)
def test_streamed_run_trains_exactly_the_loaded_run_and_resumes_exactly(text_file, tmp_path):
    def cfg(budget):
        return _cfg(text_file, budget, **{"parallel.runtime": "sim"})

    setup = helpers.assert_streamed_equals_loaded(cfg, BUDGET_MIB, tmp_path)
    assert isinstance(setup.stream.shards_RxS, np.memmap)


@pytest.mark.slow  # ~40 s; the mesh's per-device reads: test_on_devices_reads_each_devices_replicas
def test_streamed_run_on_the_mesh_trains_exactly_the_loaded_run(text_file, tmp_path):
    mesh = {"parallel.runtime": "mesh", "parallel.replica_devices": 2, "parallel.data_devices": 2}
    runs = [train(_cfg(text_file, budget, **mesh), tmp_path / str(budget),
                  show_progress=False)["state"] for budget in (0, BUDGET_MIB)]  # fmt: skip
    chex.assert_trees_all_equal(*jax.device_get(runs))


def test_what_cannot_be_streamed_is_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="compressed and cannot be streamed|cannot be streamed"):
        load_corpus(str(SHAKESPEARE), val_fraction=0.05, max_bytes=1000)
    from diloco_jax.config import apply_overrides, load_preset, problems

    digits = apply_overrides(load_preset("configs/digits.py"), [("data.max_memory_mib", "0.1")])
    with pytest.raises(DataError, match="only tfds:NAME image datasets stream from disk"):
        problems.load(digits, 4)
