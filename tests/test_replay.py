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


def test_a_link_adds_each_pushs_way_up_and_each_answers_way_down():
    # 100 kB/s and 50 ms each way: a push of 1,000 bytes is in 0.06 s after it leaves, an
    # answer of 2,000 bytes reaches the learner 0.07 s after the syncer sends it
    pace = replay.through_link(PACE, bandwidth=1e5, latency=0.05, up_bytes=1000,
                               down_bytes=2000)  # fmt: skip
    assert (pace.up_s, pace.transfer_s) == pytest.approx((0.06, 0.37))
    r = replay.replay(_config(4), pace)
    # every round's push goes up (the last one too: it closes the run); 3 answers come down
    assert r.wall_s == pytest.approx(5 + 5 + 4 * 4.0 + 4 * 0.06 + 3 * 0.37 + 3)


def test_behind_links_of_their_own_the_pushes_in_flight_share_the_syncers_link():
    # 100 kB/s and 50 ms, every party: two pushes of 1,000 bytes at once through one syncer's
    # link take 0.02 s (0.01 each alone), then 50 ms; two answers of 2,000 bytes 0.04 s + 50 ms,
    # after the merge's 0.3 s
    nics = replay.Nics(bandwidth=1e5, latency=0.05, up_bytes=1000, down_bytes=2000)
    r = replay.replay(_config(4), PACE._replace(nics=nics))
    assert r.wall_s == pytest.approx(5 + 5 + 4 * 4.0 + 4 * 0.07 + 3 * 0.39 + 3)
    # two shards: each takes half of every push, so the two go at their own NICs' rate (0.01 s
    # up, 0.02 s down); shard 1 hears how the round closed from shard 0: 2 x 50 ms more down
    r = replay.replay(_config(4), PACE._replace(nics=nics._replace(shards=2)))
    assert r.wall_s == pytest.approx(5 + 5 + 4 * 4.0 + 4 * 0.06 + 3 * (0.3 + 0.07 + 0.1) + 3)


def test_behind_links_a_push_alone_in_flight_goes_at_its_learners_own_rate():
    # a quorum of one, learner 1 at half speed: their pushes never overlap on the syncer's
    # link, so each takes 1,000 bytes / 100 kB/s + 50 ms, however many learners share it
    nics = replay.Nics(bandwidth=1e5, latency=0.05, up_bytes=1000, down_bytes=2000)
    cfg = _config(6, **{"syncer.quorum": 1, "syncer.grace": 0.01, "syncer.max_late": 8})
    r = replay.replay(cfg, PACE._replace(nics=nics, transfer_s=0.0), speeds=[1.0, 0.5])
    fast = [e["time"] for e in r.tape if e["event"] == "pushed" and e["learner"] == 0]
    assert fast[0] == pytest.approx(5 + 5 + 4.0 + 0.06)  # alone: 0.01 s up, then 50 ms
    # to its next push: the grace, its answer alone (0.02 s, 50 ms), 4 s of steps, its push
    assert fast[1] - fast[0] == pytest.approx(0.01 + 0.07 + 4.0 + 0.06)


def test_behind_links_flows_of_a_real_models_size_end():
    # 400 MB pushes through 8 shards' links: the bytes left of equal flows that end together
    # are float sums, a few bytes off zero; they end all the same (this once looped forever)
    nics = replay.Nics(bandwidth=125e6, latency=0.02, up_bytes=400_000_000,
                       down_bytes=400_000_000, shards=8)  # fmt: skip
    long = 500  # rounds of 50 s: late enough on the clock for the sums to miss zero
    cfg = _config(3, **{"syncer.learners": 8, "syncer.examples": 8 * 3 * long * ROWS,
                        "outer.sync_every": long})  # fmt: skip
    r = replay.replay(cfg, PACE._replace(step_s=(0.1,) * 8, nics=nics), limit_s=1e4)
    assert r.rounds == 3
    # each round: 50 s of steps, 3.2 s up and 20 ms; between rounds 0.3 s, 3.2 s down, 60 ms
    # (shard 0 tells the others how the round closed: twice the latency more)
    assert r.wall_s == pytest.approx(5 + 5 + 3 * (50.0 + 3.22) + 2 * (0.3 + 3.2 + 0.06) + 3)


@pytest.mark.parametrize("mode", ["delayed", "eager"])
def test_overlapped_rounds_wait_only_for_what_a_round_of_steps_does_not_hide(mode):
    # the answer comes 0.3 s after a push, within the 4 s of the next round's steps: no wait
    r = replay.replay(_config(4, **{"outer.mode": mode}), PACE)
    assert r.wall_s == pytest.approx(5 + 5 + 4 * 4.0 + 3)
    assert all(w == 0.0 for waits in r.waited.values() for w in waits)
    # an answer 5 s after its push: each sync after the first waits 1 s for it, then pushes
    # (the first sync has no answer to wait for)
    slow = PACE._replace(transfer_s=5.0)
    r = replay.replay(_config(4, **{"outer.mode": mode}), slow)
    pushed = [e["time"] for e in r.tape if e["event"] == "pushed" and e["learner"] == 0]
    assert pushed == pytest.approx([14.0, 19.0, 24.0, 29.0])
    assert r.wall_s == pytest.approx(29.0 + 3)
    assert r.waited[0] == pytest.approx([1.0, 1.0, 1.0])  # the 4th answer: the run has ended
    # synchronous rounds wait for every answer: 5 s each
    assert replay.replay(_config(4), slow).wall_s == pytest.approx(5 + 5 + 16 + 3 * 5.0 + 3)


def test_streamings_overlap_trains_tau_steps_while_a_push_travels():
    # tau = 10 steps (1 s): an answer 0.3 s after its push is in before the learner needs it
    cfg = _config(4, **{"streaming.overlap": 10})
    assert replay.replay(cfg, PACE).wall_s == pytest.approx(5 + 5 + 4 * 4.0 + 3)
    # an answer 5 s after its push: 1 s of steps, 4 s of waiting, the round's other 3 s
    r = replay.replay(cfg, PACE._replace(transfer_s=5.0))
    pushed = [e["time"] for e in r.tape if e["event"] == "pushed" and e["learner"] == 0]
    assert pushed == pytest.approx([14.0, 22.0, 30.0, 38.0])
    assert r.wall_s == pytest.approx(38.0 + 3)
    assert r.waited[0] == pytest.approx([4.0, 4.0, 4.0])
