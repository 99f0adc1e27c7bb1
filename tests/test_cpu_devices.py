"""``parallel.cpu_devices``: the CPU split into XLA devices before JAX starts, so replicas run
side by side on its cores (issue 13). Each split is checked in a fresh process: JAX fixes its
device count when it starts, and this test process already runs with 8 fake devices."""

import json
import os
import subprocess
import sys

import pytest

from diloco_jax.runtime import parallel
from diloco_jax.train import main
from tests.helpers import child_env

CHILD = """
import json, sys
import jax
from diloco_jax.runtime import parallel
done = parallel.split_cpu(int(sys.argv[1]), auto=int(sys.argv[2]))
print(json.dumps([done, jax.device_count()]))
"""


def _fresh_env(xla_flags: str = "") -> dict:
    """No device count of the suite's (its compiler options kept): only ``xla_flags``'s."""
    env = {k: v for k, v in child_env().items() if k != "JAX_NUM_CPU_DEVICES"}
    return {**env, "XLA_FLAGS": f"{env['XLA_FLAGS']} {xla_flags}".strip(), "JAX_PLATFORMS": "cpu"}


@pytest.mark.parametrize(
    "xla_flags, devices, auto, expected",
    [
        ("", 0, 2, [2, 2]),  # auto splits
        ("", 0, 1, [0, 1]),  # an auto of one leaves JAX as it was
        ("--xla_force_host_platform_device_count=3", 0, 2, [0, 3]),  # the user's count wins
        ("--xla_force_host_platform_device_count=3", 2, 1, [2, 2]),  # unless the key says
    ],
)
def test_split_before_jax_starts(xla_flags, devices, auto, expected):
    done = subprocess.run([sys.executable, "-c", CHILD, str(devices), str(auto)],
                          env=_fresh_env(xla_flags), capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected


def test_after_jax_started_only_a_different_explicit_count_is_an_error():
    running = len(parallel.jax.devices("cpu"))
    assert parallel.split_cpu(0, auto=2, environ={}) == 0  # auto: skipped
    assert parallel.split_cpu(running, auto=1) == 0  # the count it runs with: fine
    with pytest.raises(ValueError, match=f"cpu_devices = 3 is invalid here: JAX already runs "
                       f"with {running} CPU devices"):  # fmt: skip
        parallel.split_cpu(3, auto=1)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"replicas": 4, "runtime": "auto", "cores": 2}, 2),
        ({"replicas": 6, "runtime": "auto", "cores": 4}, 3),  # as many as divide the replicas
        ({"replicas": 5, "runtime": "auto", "cores": 2}, 1),
        ({"replicas": 1, "runtime": "mesh", "cores": 16}, 1),  # one model: one device
        ({"replicas": 8, "runtime": "sim", "cores": 8}, 1),  # the simulator: one device
        ({"replicas": 8, "runtime": "mesh", "replica_devices": 4, "cores": 2}, 4),  # as asked
        ({"replicas": 8, "runtime": "auto", "data_devices": 2, "cores": 2}, 2),
    ],
)
def test_cpu_devices_for(kwargs, expected):
    assert parallel.cpu_devices_for(**kwargs) == expected


def test_a_count_jax_cannot_take_any_more_is_one_line(tmp_path, capsys):
    code = main(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "run"),
                 "--config.parallel.cpu_devices=3"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: config key parallel.cpu_devices = 3 is invalid")
    assert len(err.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_split_too_late_for_auto_is_said_in_one_line(monkeypatch, caplog):
    """``fit`` after the user's own JAX work: JAX runs with one CPU device where ``auto`` would
    have split it in 4; the run goes on (the replicas share the device) and says why in one
    line (issue 39)."""
    import logging

    import jax

    from diloco_jax.run import placement
    from tests.test_checkpoint import tiny

    assert len(jax.devices()) > 1  # JAX has started (with the suite's fake devices)
    caplog.set_level(logging.WARNING, logger="diloco_jax")
    logger = logging.getLogger("diloco_jax")  # it does not propagate once a run set it up
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    monkeypatch.setattr(parallel, "_count_set_by_user", lambda environ: False)
    monkeypatch.setattr(jax, "devices", lambda *kind: jax.local_devices()[:1])
    placement.split_cpu(tiny(**{"parallel.replicas": 4, "parallel.runtime": "auto"}))
    said = [r.getMessage() for r in caplog.records if "too late to split" in r.getMessage()]
    assert len(said) == 1 and "with 1 CPU device(s), too late to split the CPU into 4" in said[0]
    monkeypatch.setattr(parallel, "_count_set_by_user", lambda environ: True)  # the user's count
    placement.split_cpu(tiny(**{"parallel.replicas": 4, "parallel.runtime": "auto"}))
    assert len([r for r in caplog.records if "too late" in r.getMessage()]) == 1


def _train(workdir, *args) -> tuple[str, list[dict]]:
    done = subprocess.run(
        [sys.executable, "-m", "diloco_jax.train", "--config", "configs/tiny.py", "--workdir",
         str(workdir), "--config.train.total_steps=20", "--config.train.sample_chars=0", *args],
        env=_fresh_env(), capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    events = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return done.stderr, events


@pytest.mark.slow  # ~60 s: two commands; by default the split itself before JAX starts
# (test_split_before_jax_starts), the command applying it (test_a_count_jax_cannot_take_any_more)
# and the mesh training what the simulator trains (test_parallel)
def test_split_cpu_trains_like_one_device(tmp_path):
    """The entry point splits the CPU (2 devices, 2 replicas each, on the mesh runtime) and
    trains what one device trains, sync diagnostics included."""
    err_one, one = _train(tmp_path / "one", "--config.parallel.cpu_devices=1")
    err_two, two = _train(tmp_path / "two", "--config.parallel.cpu_devices=2")
    assert "4 replicas on sim (1 replica x 1 data" in err_one
    assert "4 replicas on mesh (2 replica x 1 data" in err_two
    assert one[-1]["event"] == two[-1]["event"] == "done"
    assert two[-1]["final_eval_loss"] == pytest.approx(one[-1]["final_eval_loss"], abs=1e-4)
    syncs = [[e["pairwise_cosine"] for e in run if e["event"] == "sync"] for run in (one, two)]
    assert len(syncs[0]) == 4 and syncs[1] == pytest.approx(syncs[0], abs=1e-4)
