"""The memory plan (issue 14): per-device bytes from shapes alone equal what the placed state
really takes on each device, the parts add up to XLA's own figure, and a run that does not fit
stops before its first step (``--dry_run`` prints the plan without allocating anything)."""

import jax
import pytest

from diloco_jax.config import ConfigError
from diloco_jax.run import memory, placement
from diloco_jax.run.setup import build, chunk_control
from diloco_jax.train import main, train
from tests.test_train import tiny

LAYOUTS = {
    "sim": {"parallel.runtime": "sim"},
    "mesh 2x2": {"parallel.runtime": "mesh", "parallel.replica_devices": 2,
                 "parallel.data_devices": 2},
    "mesh 1x4": {"parallel.runtime": "mesh", "parallel.replica_devices": 1,
                 "parallel.data_devices": 4},
}  # fmt: skip


def _real_bytes_on_first_device(tree) -> int:
    first = jax.local_devices()[0]
    return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
               if shard.device == first)  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_from_shapes_equal_the_placed_state(layout):
    cfg = tiny(**LAYOUTS[layout])
    shapes, placed = build(cfg, abstract=True), build(cfg)
    assert isinstance(jax.tree.leaves(shapes.state)[0], jax.ShapeDtypeStruct)
    for field in placed.state._fields:
        expected = _real_bytes_on_first_device(getattr(placed.state, field))
        assert memory.bytes_per_device(getattr(shapes.state, field)) == expected, field
    for name in ("shards_RxS", "eval_windows", "replicas_R"):
        expected = _real_bytes_on_first_device(getattr(placed, name))
        assert memory.bytes_per_device(getattr(shapes, name)) == expected, name


def _plan(cfg):
    s = build(cfg, abstract=True)
    compiled = s.run_chunk.lower(s.state, s.replicas_R, s.shards_RxS,
                                 chunk_control(cfg, s, 0)).compile()  # fmt: skip
    return s, compiled, placement.memory_plan(s, compiled)


def test_parts_add_up_to_xla():
    s, compiled, plan = _plan(tiny(**{"parallel.runtime": "sim"}))
    m = compiled.memory_analysis()
    xla = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    xla += m.temp_size_in_bytes
    resident = memory.bytes_per_device(s.eval_windows)
    assert plan.total == sum(n for _, n in plan.parts) == xla + resident
    assert dict(plan.parts)["XLA temporaries (activations, gradients)"] == m.temp_size_in_bytes


def test_state_grows_by_what_a_replica_holds():
    setups = [build(tiny(**{"parallel.runtime": "sim", "parallel.replicas": r}), abstract=True)
              for r in (2, 4)]  # fmt: skip
    two, four = ({f: memory.bytes_per_device(getattr(s.state, f)) for f in s.state._fields}
                 for s in setups)  # fmt: skip
    assert four["params"] == 2 * two["params"] and four["inner_state"] == 2 * two["inner_state"]
    assert four["anchor"] == two["anchor"] > 0  # held once, whatever R
    assert four["outer_state"] == two["outer_state"] > 0
    # the corpus is split among the replicas, never copied (a split drops at most R-1 windows)
    data = [memory.bytes_per_device(s.shards_RxS) for s in setups]
    assert data[0] - 4 * 4 <= data[1] <= data[0]


def test_dry_run_prints_the_plan_and_allocates_nothing(tmp_path, capsys):
    workdir = tmp_path / "run"
    assert main(["--config", "configs/tiny.py", "--workdir", str(workdir), "--dry_run"]) == 0
    out = capsys.readouterr().out
    for part in ("params", "inner_state", "anchor", "outer_state", "XLA temporaries", "total"):
        assert f"  {part}" in out
    assert "a device has" in out and not workdir.exists()


def test_a_run_that_does_not_fit_stops_before_its_first_step(tmp_path, capsys):
    flags = ["--config", "configs/tiny.py", "--workdir", str(tmp_path / "dry"),
             "--config.parallel.device_memory_gib=0.001", "--dry_run"]  # fmt: skip
    assert main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the run needs ")
    assert "more than the 1.02 MiB of one device (parallel.device_memory_gib)" in err[0]
    cfg = tiny(**{"parallel.runtime": "sim", "parallel.device_memory_gib": 0.001})
    with pytest.raises(ConfigError, match="the run needs .* per device"):
        train(cfg, tmp_path / "run", show_progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )


def test_chunks_shrink_the_temporaries_and_offload_the_state():
    """The chunked simulator's plan: one chunk's activations (the sync has none); with
    sim.offload only one chunk's per-replica state is on the device."""
    base = {"parallel.runtime": "sim", "parallel.replicas": 4}
    _, _, whole = _plan(tiny(**base))
    _, _, offload = _plan(tiny(**base, **{"sim.chunk": 1, "sim.offload": True}))
    whole, offload = dict(whole.parts), dict(offload.parts)
    temps = "XLA temporaries (activations, gradients)"
    assert offload[temps] < whole[temps]
    assert whole["params"] == 4 * offload["params"] > 0
    assert offload["anchor"] == whole["anchor"] > 0  # shared: on the device whole


def test_a_dry_run_builds_the_model_from_shapes_and_its_hint_names_what_is_not_set(
    tmp_path, capsys
):
    """Nothing of the model is allocated (issue 54: lm_1b's dry run held its 4 GB of
    parameters); the hint leaves out model.remat where the run sets it."""
    from diloco_jax.config import problems

    problem = problems.load(tiny(), 4, abstract=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(problem.params))
    layouts = {
        "sim": ["--config.parallel.runtime=sim"],
        "mesh": ["--config.parallel.runtime=mesh", "--config.parallel.replica_devices=2"],
    }
    for runtime, remat in (("sim", "false"), ("mesh", "true")):
        flags = ["--config", "configs/tiny.py", "--workdir", str(tmp_path / remat),
                 "--config.parallel.device_memory_gib=0.001", *layouts[runtime],
                 f"--config.model.remat={remat}", "--dry_run"]  # fmt: skip
        assert main(flags) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert "a smaller data.batch_size (now 4)" in line
        assert ("model.remat=true" in line) == (remat == "false"), line
        if runtime == "sim":  # what the simulator takes, not a mesh's keys
            assert "sim.chunk=K" in line and "parallel.replica_devices" not in line
        else:
            assert (
                "fewer replicas per device (parallel.replica_devices, 2 replicas a device" in line
            )
