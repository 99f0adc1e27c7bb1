"""The replay of learners and a syncer on a virtual clock (``sim/replay.py``): its arithmetic on
cases worked by hand, and :func:`measure` reading back the pace a replay ran at."""

import json

import pytest

from diloco_jax import config as config_lib
from sim import replay

H, ROWS = 40, 8
PACE = replay.Pace(step_s=(0.1, 0.1), startup_s=5.0, compile_s=5.0, transfer_s=0.3, tail_s=3.0)


def _config(rounds: int, **keys) -> config_lib.Config:
    cfg = config_lib.load_preset("tiny")
    values = {"outer.sync_every": H, "data.batch_size": ROWS, "parallel.replicas": 1,
              "syncer.learners": 2, "syncer.examples": 2 * rounds * H * ROWS,
              "syncer.dead_after": 20.0, **keys}  # fmt: skip
    for key, value in values.items():
        cfg = config_lib.override(cfg, key, str(value))
    return cfg


def test_synchronous_rounds_add_up():
    # start-up, compile, then 4 rounds of 40 steps, an answer between rounds, the tail
    r = replay.replay(_config(4), PACE)
    assert r.wall_s == pytest.approx(5 + 5 + 4 * 4.0 + 3 * 0.3 + 3)
    assert (r.rounds, r.useful_steps, r.kills, r.late_pushes) == (4, 2 * 4 * H, 0, 0)


def test_a_killed_learner_holds_synchronous_rounds_back_by_its_restart():
    # killed as round 2 closes: its new process joins 5 s later, compiles (the restart's
    # compile, from the cache: 1 s), takes the round's steps; the other waits at the barrier
    pace = PACE._replace(restart_compile_s=1.0)
    r = replay.replay(_config(4), pace, kill=(0, 2))
    clean = 5 + 5 + 4 * 4.0 + 3 * 0.3 + 3
    assert r.kills == 1
    assert r.wall_s == pytest.approx(clean + 5 + 1 - 0.3)  # its join needs no answer
    joined = [e for e in r.tape if e["event"] == "joined" and e["learner"] == 0]
    assert [e["generation"] for e in joined] == [1, 2]


def test_under_a_quorum_a_slow_learner_merges_late_and_the_fast_one_goes_on():
    cfg = _config(8, **{"syncer.quorum": 1, "syncer.grace": 0.5, "syncer.max_late": 8})
    r = replay.replay(cfg, PACE, speeds=[1.0, 0.5])
    fast = [e for e in r.tape if e["event"] == "pushed" and e["learner"] == 0]
    slow = [e for e in r.tape if e["event"] == "pushed" and e["learner"] == 1]
    assert r.late_pushes > 0 and all(e["late"] == 0 for e in fast)
    assert len(fast) > 1.5 * len(slow)
    gaps = [b["time"] - a["time"] for a, b in zip(fast, fast[1:], strict=False)]
    assert max(gaps) <= 4.0 + 0.3 + 0.5 + 1e-9  # its round, an answer, at most one grace
    assert r.useful_steps == 2 * 8 * H  # the examples budget, whoever brought them


def test_measure_reads_back_the_pace_a_run_went_at(tmp_path):
    pace = PACE._replace(step_s=(0.1, 0.125), compile_s=4.0)
    r = replay.replay(_config(5), pace)
    started = 1000.0  # the launch, on the Unix clock; the replay's clock starts there
    (tmp_path / "syncer").mkdir()
    (tmp_path / "syncer" / "syncer.jsonl").write_text("".join(
        json.dumps({**e, "time": started + e["time"]}) + "\n" for e in r.tape))  # fmt: skip
    for i, waits in r.waited.items():
        (tmp_path / f"learner_{i}").mkdir()
        (tmp_path / f"learner_{i}" / "metrics.jsonl").write_text("".join(
            json.dumps({"event": "round", "seconds_waited": w}) + "\n" for w in waits))  # fmt: skip
    (tmp_path / "learner_0" / "config.json").write_text(json.dumps({"outer": {"sync_every": H}}))
    measured = replay.measure(tmp_path, started, r.wall_s)
    assert measured.step_s == pytest.approx(pace.step_s)
    for key in ("startup_s", "compile_s", "transfer_s", "tail_s"):
        assert getattr(measured, key) == pytest.approx(getattr(pace, key)), key
