"""Multi-process set-up and checks that need no second process: settings from flags and the
environment, cluster detection, the anchor fingerprint and the check that compares devices."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.config import ConfigError
from diloco_jax.run import distributed
from diloco_jax.run.distributed import Cluster, ConsistencyError, resolve
from diloco_jax.runtime import parallel
from diloco_jax.train import main
from tests import helpers

ENV = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
       "JAX_PROCESS_ID": "2"}  # fmt: skip


def test_settings_come_from_flags_then_environment():
    assert resolve(Cluster(), environ=ENV) == Cluster("10.0.0.1:1234", 4, 2)
    assert resolve(Cluster(process_id=3), environ=ENV).process_id == 3  # a flag wins
    assert resolve(Cluster(), environ={}) == Cluster()  # nothing set: one process


@pytest.mark.parametrize(
    "cluster,env,match",
    [
        (Cluster(num_processes=2), {}, r"incomplete: --coordinator_address \(or JAX_COORDINATOR"),
        (
            Cluster(),
            {**ENV, "JAX_PROCESS_ID": "4"},
            r"process_id = 4 is invalid: must be in \[0, 4\)",
        ),
        (Cluster(coordinator_address="nohost"), ENV, "'nohost' is invalid: expected HOST:PORT"),
        (Cluster(), {**ENV, "JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES = 'two' is not an int"),
        (Cluster(mode="yes"), {}, r"--distributed = 'yes' is invalid"),
    ],
)
def test_bad_settings_name_the_value(cluster, env, match):
    with pytest.raises(ConfigError, match=match):
        resolve(cluster, environ=env)


def test_cli_bad_process_id_is_one_line_before_any_work(tmp_path, capsys):
    argv = ["--config", "configs/tiny.py", "--workdir", str(tmp_path / "w"), "--num_processes",
            "2", "--process_id", "2", "--coordinator_address", "127.0.0.1:1"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: process_id = 2 is invalid: must be in [0, 2)"]
    assert not (tmp_path / "w").exists()


def test_joining_without_a_cluster_is_a_clear_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "diloco_jax.train", "--config", "configs/tiny.py", "--workdir",
         str(tmp_path / "w"), "--distributed", "on", "--init_timeout", "5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not join the run of a cluster JAX detects"), last
    assert not (tmp_path / "w").exists()


SRUN = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "4",
        "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}  # fmt: skip
SALLOC = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[01-02]"}


def test_cluster_detection():
    """SLURM: the variables JAX's own SlurmCluster.is_env_present reads, and several tasks."""
    from jax._src.clusters.slurm_cluster import SlurmCluster

    assert distributed.detected_cluster(SRUN) == "SLURM"
    assert distributed.detected_cluster({**SRUN, "SLURM_NTASKS": "1"}) is None
    for name in distributed.SLURM_VARS:  # JAX needs each of them
        environ = {k: v for k, v in SRUN.items() if k != name}
        assert distributed.detected_cluster(environ) is None
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("os.environ", environ)
            assert not SlurmCluster.is_env_present()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("os.environ", SRUN)
        assert SlurmCluster.is_env_present()
    assert distributed.detected_cluster(SALLOC) is None
    mpi = {"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}
    assert distributed.detected_cluster(mpi) == "Open MPI"
    assert distributed.detected_cluster({}) is None


def test_slurm_allocation_without_srun_says_what_to_do():
    with pytest.raises(ConfigError) as e:
        resolve(Cluster(), environ=SALLOC)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("SLURM allocation found (SLURM_JOB_ID=7, SLURM_NTASKS=4) but this "
                              "process was not started by srun")  # fmt: skip
    assert 'run it as "srun python -m diloco_jax.train ...' in message
    assert "--distributed off" in message
    with pytest.raises(ConfigError, match="not started by srun"):
        resolve(Cluster(mode="on"), environ=SALLOC)
    # what still runs: one task, --distributed off, under srun, explicit settings
    assert resolve(Cluster(), environ={**SALLOC, "SLURM_NTASKS": "1"}) == Cluster()
    assert resolve(Cluster(mode="off"), environ=SALLOC) == Cluster(mode="off")
    assert resolve(Cluster(), environ=SRUN) == Cluster()
    assert resolve(Cluster(), environ={**SALLOC, **ENV}) == Cluster("10.0.0.1:1234", 4, 2)


def test_salloc_shell_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    for name, value in SALLOC.items():
        monkeypatch.setenv(name, value)
    assert main(["--config", "tiny", "--workdir", str(tmp_path / "w")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: SLURM allocation found"), line
    assert not (tmp_path / "w").exists()


def test_fingerprint_sees_one_flipped_bit_and_a_swap():
    x = jax.random.normal(jax.random.key(0), (64, 33))
    tree = {"a": x, "b": jnp.arange(5, dtype=jnp.float32).astype(jnp.bfloat16)}
    base = int(distributed.fingerprint(tree))
    assert int(jax.jit(distributed.fingerprint)(tree)) == base  # the same under jit
    bits = np.asarray(x).view(np.uint32).copy()
    for flat_index, bit in [(0, 0), (1000, 31), (64 * 33 - 1, 17)]:
        flipped = bits.copy().reshape(-1)
        flipped[flat_index] ^= np.uint32(1 << bit)
        other = {**tree, "a": jnp.asarray(flipped.view(np.float32).reshape(x.shape))}
        assert int(distributed.fingerprint(other)) != base
    swapped = np.asarray(x).copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert int(distributed.fingerprint({**tree, "a": jnp.asarray(swapped)})) != base


def test_devices_holding_different_anchors_are_named():
    layout = parallel.Layout("mesh", 4, 4, 1)
    mesh = parallel.make_mesh(layout)
    devices = list(mesh.devices.flat)
    fingerprints = distributed.make_device_fingerprints(mesh)
    good = np.arange(12, dtype=np.float32).reshape(3, 4)
    same = parallel.replicated({"w": good}, mesh)
    values = jax.device_get(fingerprints(same))
    assert len(values) == 4 and len(set(values.tolist())) == 1
    distributed.check_same(values, devices, "the anchor")  # no error
    # a "replicated" array whose copy on the third device differs by one ulp
    bad = good.copy()
    bad[1, 2] = np.nextafter(bad[1, 2], np.float32(100))
    copies = [jax.device_put(bad if i == 2 else good, d) for i, d in enumerate(devices)]
    skewed = jax.make_array_from_single_device_arrays(good.shape, NamedSharding(mesh, P()), copies)
    values = jax.device_get(fingerprints({"w": skewed}))
    with pytest.raises(ConsistencyError, match=rf"process 0 \(devices \[{devices[2].id}\]\) "
                                               r"disagree with process 0"):  # fmt: skip
        distributed.check_same(values, devices, "the anchor")


def test_debug_check_compares_every_shared_field_and_names_it():
    from diloco_jax.config import apply_overrides, load_preset
    from diloco_jax.run.distributed import check_replicated
    from diloco_jax.run.setup import build

    overrides = [("parallel.runtime", "mesh"), ("parallel.replica_devices", "2"),
                 ("parallel.replicas", "2"), ("outer.sync_every", "10"),
                 ("train.check_replicated", "true")]  # fmt: skip
    s = build(apply_overrides(load_preset("configs/tiny.py"), overrides))
    step = s.cfg.train.log_every  # 5: the first call holds no sync (sync_every 10)
    check_replicated(s, s.state, step)  # the initial state is the same everywhere
    leaves, treedef = jax.tree.flatten(s.state.outer_state)
    i = next(i for i, x in enumerate(leaves) if x.ndim)
    leaves[i] = helpers.skew_last_device(leaves[i])
    skewed = s.state._replace(outer_state=jax.tree.unflatten(treedef, leaves))
    with pytest.raises(ConsistencyError, match="the shared outer_state after step"):
        check_replicated(s, skewed, step)
    # the default, cheap check compares only the anchor, after calls that contain a sync
    cheap = dataclasses.replace(s, cfg=apply_overrides(s.cfg, [("train.check_replicated", "0")]))
    check_replicated(cheap, skewed, step)
    anchor = jax.tree.map(helpers.skew_last_device, s.state.anchor)
    with pytest.raises(ConsistencyError, match="the shared anchor after step"):
        check_replicated(cheap, s.state._replace(anchor=anchor), s.cfg.outer.sync_every)
