"""The simulator: bytes, the network clock, stragglers (DyLU), failures, and the sweep CLI."""

import csv
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import SyncPlan, diloco, optim
from diloco_jax.config import Config, ConfigError, apply_overrides, validate
from diloco_jax.simulated import comms, schedule
from sim import clock
from tests import helpers


def test_payload_and_bytes_hand_computed():
    tree = {"w": jnp.zeros((3, 4), jnp.float32), "b": jnp.zeros(5, jnp.bfloat16)}
    assert comms.payload_bytes(tree) == 3 * 4 * 4 + 5 * 2
    assert comms.payload_bytes(tree, jnp.bfloat16) == 17 * 2
    # ring: 2 (R - 1) / R * P; parameter server: P (it receives as much); one sends nothing
    assert comms.bytes_per_replica(1000, 4, "ring") == 1500
    assert comms.bytes_per_replica(1000, 4, "parameter_server") == 1000
    assert comms.bytes_per_replica(1000, 1, "ring") == 0
    assert comms.reduces("diloco", 100, 10) == 10 and comms.reduces("ddp", 100, 10) == 100
    assert comms.reduces("single", 100, 10) == 0


def test_reduce_time_hand_computed():
    net = comms.Network(bandwidth_gbps=8.0, latency_ms=1.0)  # 1e9 bytes/s
    # ring, R=2, P=1e6: 2 * (2 - 1) * (1 ms + 0.5e6 B / 1e9 B/s) = 2 * 1.5 ms
    assert comms.reduce_seconds(10**6, 2, net, "ring") == pytest.approx(3e-3)
    # server: 2 * (1 ms + 2 * 1e6 / 1e9) = 6 ms
    assert comms.reduce_seconds(10**6, 2, net, "parameter_server") == pytest.approx(6e-3)


def test_network_clock_two_replicas_hand_computed():
    net = comms.Network(bandwidth_gbps=8.0, latency_ms=1.0)
    kw = dict(steps=20, sync_every=10, replicas=2, step_time_s=0.1, payload_bytes=10**6,
              network=net)  # fmt: skip
    # replica 1 at half speed: a round computes max(10 * 0.1, 10 * 0.2) = 2 s, reduce 3 ms
    c = clock.simulate(algorithm="diloco", speeds=np.array([1.0, 0.5]), dylu=False, **kw)
    assert c.wallclock_s == pytest.approx(2 * (2.0 + 3e-3))
    assert c.utilization == pytest.approx((2 * (1.0 + 2.0)) / (2 * c.wallclock_s))
    # DyLU: the slow replica takes 5 steps (1 s) per round: nobody idles
    d = clock.simulate(algorithm="diloco", speeds=np.array([1.0, 0.5]), dylu=True, **kw)
    assert d.wallclock_s == pytest.approx(2 * (1.0 + 3e-3))
    assert d.utilization == pytest.approx(4.0 / (2 * d.wallclock_s))
    # ddp reduces every step: 20 * (0.1 + 3 ms) at equal speeds
    e = clock.simulate(algorithm="ddp", speeds=np.ones(2), dylu=False, **kw)
    assert e.wallclock_s == pytest.approx(20 * 0.103)


def test_dylu_steps_and_masks():
    speeds = np.array([1.0, 0.5, 0.26])
    np.testing.assert_array_equal(schedule.local_steps(speeds, 10, True), [10, 5, 2])
    masks = schedule.control(0, 10, replicas=3, plan=SyncPlan(10), speeds=speeds, dylu=True,
                             drops=[], drop_prob=0.0, seed=0)  # fmt: skip
    np.testing.assert_array_equal(masks["active"].sum(0), [10, 5, 2])
    np.testing.assert_allclose(masks["weight"][9], [1.0, 0.5, 0.2])


def _quadratic_tx_run(control, replicas=3, steps=4, sync_every=2, outer=None):
    """Replicas minimise 0.5 |x - c_r|^2 with inner sgd(0.5) under explicit step controls;
    returns the parameters after every step, the final state and the metrics."""
    centers = jnp.array([[1.0], [3.0], [-2.0]])[:replicas]
    tx = diloco(optax.sgd(0.5), outer or optax.sgd(1.0), sync_every=sync_every)
    return helpers.run_vmapped(tx, jnp.zeros(1), centers, steps, control=control)


def test_weighted_mean_and_inactive_steps_hand_computed():
    # replica 2 idles on step 0; sync at step 1 with weights [2, 2, 1]
    control = {
        "active": np.array([[1, 1, 0], [1, 1, 1]], bool),
        "weight": np.array([[1, 1, 1], [2, 2, 1]], np.float32),
        "take_anchor": np.ones((2, 3), bool),
    }
    xs, state, metrics = _quadratic_tx_run(control, steps=2)
    # after two sgd(0.5) steps from 0: x = 0.75 c; one step: 0.5 c
    local = np.array([0.75 * 1.0, 0.75 * 3.0, 0.5 * -2.0])
    expected = (2 * local[0] + 2 * local[1] + 1 * local[2]) / 5  # outer sgd(1.0): weighted mean
    np.testing.assert_allclose(state.anchor, [expected], rtol=1e-6)
    np.testing.assert_allclose(xs[0][2], [0.0])  # the idle replica did not move
    assert float(metrics["contributors"][1][0]) == 3.0


def test_dropped_replica_keeps_params_then_rejoins_from_anchor():
    masks = schedule.control(0, 6, replicas=3, plan=SyncPlan(2), speeds=np.ones(3), dylu=False,
                             drops=[(2, 0, 1)], drop_prob=0.0, seed=0)  # fmt: skip
    # outer step 0 (t=1): replica 2 out, keeps params; outer step 1 (t=3): back, restarts from
    # the anchor but its stale pseudo-gradient is left out; outer step 2 (t=5): contributes
    np.testing.assert_array_equal(masks["weight"][[1, 3, 5], 2], [0, 0, 1])
    np.testing.assert_array_equal(masks["take_anchor"][[1, 3, 5], 2], [False, True, True])
    xs, state, metrics = _quadratic_tx_run(masks, steps=6)
    np.testing.assert_allclose(xs[1][0], xs[1][1])  # replicas 0, 1 on the anchor
    np.testing.assert_allclose(xs[1][2], [0.75 * -2.0], rtol=1e-6)  # replica 2 kept its own
    np.testing.assert_allclose(xs[3][2], xs[3][0])  # rejoined at the anchor
    assert float(metrics["contributors"][5][0]) == 3.0


def test_all_dropped_skips_the_outer_step():
    control = {"active": np.ones((2, 2), bool), "weight": np.zeros((2, 2), np.float32),
               "take_anchor": np.ones((2, 2), bool)}  # fmt: skip
    xs, state, _ = _quadratic_tx_run(control, replicas=2, steps=2,
                                  outer=optim.outer_nesterov())  # fmt: skip
    np.testing.assert_allclose(state.anchor, [0.0])  # anchor and momentum untouched
    np.testing.assert_allclose(xs[1], np.zeros((2, 1)))  # everyone back on the anchor
    momentum = jax.tree.leaves(state.outer_state)
    assert momentum and all(float(np.abs(m).sum()) == 0.0 for m in momentum)


def _lm_tx(ax):
    return diloco(helpers.adamw(), optax.sgd(1.0), sync_every=3, axis_name=ax)


def test_replica_dropped_for_all_syncs_equals_a_run_without_it():
    steps, replicas = 9, 3
    masks = schedule.control(0, steps, replicas=replicas, plan=SyncPlan(3), speeds=np.ones(3),
                             dylu=False, drops=[(2, 0, 100)], drop_prob=0.0, seed=0)  # fmt: skip
    with_drop, _ = helpers.run(_lm_tx, helpers.sim(replicas), steps, control=masks)
    without, _ = helpers.run(_lm_tx, helpers.sim(2), steps, shards=replicas)
    chex.assert_trees_all_close(with_drop.anchor, without.anchor, atol=1e-6)


@pytest.mark.slow  # ~20 s; the masks are checked by hand by default
def test_drop_probability_zero_and_dylu_equal_speeds_equal_plain_run():
    steps = 6
    plain, _ = helpers.run(_lm_tx, helpers.sim(2), steps)
    for dylu, p in ((True, 0.0), (False, 0.0)):
        masks = schedule.control(0, steps, replicas=2, plan=SyncPlan(3), speeds=np.ones(2),
                                 dylu=dylu, drops=[], drop_prob=p, seed=0)  # fmt: skip
        other, _ = helpers.run(_lm_tx, helpers.sim(2), steps, control=masks)
        for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(other), strict=True):
            np.testing.assert_array_equal(a, b)


def test_drop_probability_is_seeded():
    kw = dict(replicas=8, drops=[], drop_prob=0.5)
    a = [schedule.connected(k, seed=0, **kw) for k in range(20)]
    assert all((x == y).all() for x, y in zip(a, [schedule.connected(k, seed=0, **kw)
                                                   for k in range(20)], strict=True))  # fmt: skip
    frac = np.mean(a)
    assert 0.35 < frac < 0.65


@pytest.mark.parametrize(
    "key,value,match",
    [("sim.speeds", "1,2", "needs 4 positive numbers"), ("sim.drop", "9:0-1", "0 <= replica < 4"),
     ("sim.drop", "x", "use 'replica:first-end"), ("sim.network", "carrier-pigeon", "one of"),
     ("sim.drop_prob", "1.0", r"\[0, 1\)")],
)  # fmt: skip
def test_sim_config_errors(key, value, match):
    with pytest.raises(ConfigError, match=match):
        validate(apply_overrides(Config(), [(key, value)]))


def _watched_sweep(monkeypatch) -> tuple[int, list]:
    """A port for the sweep's server, and the list its ``/status`` is appended to (its
    ``sweep`` part, read over HTTP) as each run starts."""
    from diloco_jax.watch import serve
    from tests.test_serve import _request, free_port

    seen = []

    class Watched(serve.SweepBoard):
        def started(self, name):
            super().started(name)
            seen.append(json.loads(_request(port, "GET", "/status")[1])["sweep"])

    monkeypatch.setattr(serve, "SweepBoard", Watched)
    port = free_port()
    return port, seen


def _assert_served(seen) -> None:
    """As each of the sweep's 6 runs started, /status showed the runs done before it (their
    final losses) and their table rows."""
    assert len(seen) == 6 and [r["state"] for r in seen[1]["runs"]][:3] == [
        "done", "running", "pending"]  # fmt: skip
    assert [row["run"] for row in seen[1]["table"]] == [seen[1]["runs"][0]["run"]]
    assert seen[5]["runs"][4]["final_eval_loss"] is not None and len(seen[5]["table"]) == 5


# the outer learning rate and the seed are inputs of one compiled step (and ddp's own)
SWEEP = ["--config", "configs/tiny.py", "--sweep", "outer.learning_rate=0.5,0.7",
         "--baselines", "ddp", "--seeds", "0,1", "--config.outer.sync_every=5",
         "--config.train.total_steps=10", "--config.train.sample_chars=0",
         "--config.train.checkpoint=false"]  # fmt: skip


def _summaries(tmp_path) -> dict:
    return {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/summary.json")}


def test_the_sweep_command_around_faked_runs_serves_tables_and_reruns_nothing(
    tmp_path, capsys, monkeypatch
):
    """The sweep command with each run's training faked (what a finished run returns and
    leaves): each run gets its swept config; one server for the whole sweep, whose /status shows
    the runs done so far and their rows; the table's spread over seeds, the bytes against ddp;
    a rerun trains nothing; another network changes the clock only. The stand-in of the slow
    test below, which trains the runs and reads their figures."""
    from sim.__main__ import main

    trained = []

    def train(cfg, rundir, **_):
        trained.append((rundir.name, cfg.algorithm, cfg.outer.learning_rate, cfg.seed))
        rundir.mkdir(parents=True)
        loss = 2.0 + cfg.outer.learning_rate + cfg.seed / 10  # each run its own
        with open(rundir / "metrics.jsonl", "w") as f:
            for step in (5, 10):
                f.write(json.dumps({"event": "eval", "step": step, "eval_loss": loss + 1 / step,
                                    "tokens": step * 512}) + "\n")  # fmt: skip
        return {"final_eval_loss": loss + 0.1, "steps": 10, "tokens": 5120,
                "step_seconds": 0.01, "unit": "token", "unigram_entropy": None,
                "preempted": None, "state": None}  # fmt: skip

    monkeypatch.setattr("diloco_jax.train.train", train)
    monkeypatch.setattr(
        "diloco_jax.base.extras.missing", lambda *m: [x for x in m if x == "matplotlib"]
    )  # the slow test draws
    port, seen = _watched_sweep(monkeypatch)
    args = [*SWEEP, "--workdir", str(tmp_path), f"--config.serve.port={port}"]
    assert main(args) == 0
    want = [(f"learning_rate={lr},seed={seed}", "diloco", lr, seed)
            for lr in (0.5, 0.7) for seed in (0, 1)]  # fmt: skip
    want += [(f"ddp,seed={seed}", "ddp", 0.7, seed) for seed in (0, 1)]
    assert sorted(trained) == sorted(want)
    table = capsys.readouterr().out
    assert "| learning_rate=0.7 | 2.850 ± 0.050 |" in table, table
    _assert_served(seen)
    by_run = {r["run"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert len(by_run) == 6 and by_run["learning_rate=0.5,seed=1"]["final_eval_loss"] == "2.7"
    assert float(by_run["ddp,seed=0"]["bytes_vs_ddp"]) == pytest.approx(1.0)
    assert float(by_run["learning_rate=0.5,seed=0"]["bytes_vs_ddp"]) == pytest.approx(0.2)
    stamps = _summaries(tmp_path)
    assert len(stamps) == 6 and json.loads(next(iter(stamps)).read_text())["evals"]
    trained.clear()
    assert main(args) == 0 and trained == [] and _summaries(tmp_path) == stamps
    assert main([*args, "--config.sim.network=wan_1gbit"]) == 0 and trained == []
    wan = {r["run"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert float(wan["ddp,seed=0"]["sim_wallclock_s"]) > float(
        by_run["ddp,seed=0"]["sim_wallclock_s"])  # fmt: skip
    assert wan["ddp,seed=0"]["final_eval_loss"] == by_run["ddp,seed=0"]["final_eval_loss"]


@pytest.mark.slow  # ~30 s alone, ~55 s in the suite: six tiny trainings and their figures; the
# default suite's stand-ins: the same sweep around faked runs (above) and test_user_task's
# sweep of trained runs (test_a_python_sweep_reuses_finished_runs_of_the_same_task_only)
def test_sweep_cli_end_to_end_and_rerun_skips(tmp_path, capsys, monkeypatch):
    """The sweep, its tables and figures; with serve.port, one server for the whole sweep whose
    /status, as each run starts, shows the runs done before it and their table rows (the same
    from another process: test_serve's slow test); a rerun trains nothing."""
    from sim.__main__ import main

    port, seen = _watched_sweep(monkeypatch)
    args = [*SWEEP, "--workdir", str(tmp_path), f"--config.serve.port={port}"]
    with helpers.drawing_figures():
        assert main(args) == 0
    table = capsys.readouterr().out
    assert "| learning_rate=0.7 |" in table and "±" in table
    _assert_served(seen)
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert len(rows) == 6
    for col in ("run", "replicas", "sync_every", "tokens", "final_eval_loss",
                "bytes_per_replica", "sim_wallclock_s", "utilization"):  # fmt: skip
        assert col in rows[0]
    by_run = {r["run"]: r for r in rows}
    assert float(by_run["ddp,seed=0"]["bytes_vs_ddp"]) == pytest.approx(1.0)
    assert float(by_run["learning_rate=0.5,seed=0"]["bytes_vs_ddp"]) == pytest.approx(0.2)
    assert by_run["learning_rate=0.5,seed=0"]["final_eval_loss"] != (
        by_run["learning_rate=0.7,seed=0"]["final_eval_loss"])  # fmt: skip
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert (tmp_path / "tradeoff.png").stat().st_size > 0
    assert (tmp_path / "runs" / "ddp,seed=1" / "metrics.jsonl").exists()
    # the sync diagnostics: the sweep's and each DiLoCo run's (ddp has no syncs)
    for where in (tmp_path, tmp_path / "runs" / "learning_rate=0.7,seed=1"):
        assert (where / "drift.png").stat().st_size > 0 and (where / "cosine.png").exists()
    assert not (tmp_path / "runs" / "ddp,seed=1" / "drift.png").exists()
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/summary.json")}
    assert main(args) == 0  # everything finished: nothing is trained again
    assert stamps == {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/summary.json")}
    assert json.loads(next(iter(stamps)).read_text())["evals"]
    # another network only changes the accounting: nothing is retrained, the clock changes
    assert main([*args, "--config.sim.network=wan_1gbit"]) == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/summary.json")}
    wan = {r["run"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    slow, fast = wan["ddp,seed=0"], by_run["ddp,seed=0"]
    assert float(slow["sim_wallclock_s"]) > float(fast["sim_wallclock_s"])
    assert slow["final_eval_loss"] == fast["final_eval_loss"]


def test_sweep_tables_hold_metrics_not_bookkeeping_and_a_measured_clocks_spread(tmp_path):
    """An eval record's Unix time, seconds, outer steps and tokens are no ``final_*`` column
    (issue 54); a wall-clock from measured step times (3.8x apart here, as a busy machine made
    them) shows its min-max over seeds and a note on modelling it, in ``python -m sim``'s table
    and in ``sim.combine``'s; with ``sim.step_time_s`` the seeds agree and there is no note."""
    from sim import combine
    from sim.accounting import account
    from sim.sweep import format_table, summarize, write_csv

    params = {"w": np.zeros((4, 3), np.float32)}
    evals = [{"event": "eval", "step": 20, "time_s": 3.0, "time": 1.8e9, "eval_loss": 1.5,
              "outer_steps": 2, "tokens": 640, "accuracy": 0.75}]  # fmt: skip

    def summary(step_time_s, seconds):
        cfg = apply_overrides(Config(), [("outer.sync_every", "10"),
                                         ("sim.step_time_s", str(step_time_s))])  # fmt: skip
        rows = [account({"name": f"a,seed={i}", "steps": 20, "tokens": 640, "evals": evals,
                         "final_eval_loss": 1.5, "step_seconds": s}, cfg, params)
                for i, s in enumerate(seconds)]  # fmt: skip
        assert [k for k in rows[0] if k.startswith("final_")] == ["final_eval_loss",
                                                                   "final_accuracy"]  # fmt: skip
        return summarize(rows, {r["run"]: "a" for r in rows})

    measured = summary(0, [0.01, 0.038])
    assert "final_time" not in measured[0] and measured[0]["final_accuracy_std"] == 0.0
    low, high = measured[0]["sim_wallclock_s_min"], measured[0]["sim_wallclock_s_max"]
    assert high / low == pytest.approx(3.8, rel=0.01)
    text = format_table(measured)
    assert f"({low:.3g}-{high:.3g})" in text and "--config.sim.step_time_s=SECONDS" in text
    (tmp_path / "sweep").mkdir()
    write_csv(tmp_path / "sweep" / "summary.csv", measured)
    rows = combine.read([tmp_path / "sweep"])
    assert f"({low:.3g}-{high:.3g})" in combine.table(rows) and "note: " in combine.table(rows)
    modelled = summary(0.047, [0.01, 0.038])
    assert modelled[0]["sim_wallclock_s_min"] == modelled[0]["sim_wallclock_s_max"]
    assert format_table(modelled).splitlines()[-1].endswith("| 0.9401 | 1.00 |")  # no note


def test_sweep_list_valued_key_in_brackets():
    """``sim.speeds`` takes a comma-separated list: each swept value goes in brackets."""
    from sim import sweep

    key, values = sweep.parse_sweep("sim.speeds=[],[1, 1,0.5,0.5] , [1,1,1,0.25]")
    assert (key, values) == ("sim.speeds", ["", "1, 1,0.5,0.5", "1,1,1,0.25"])
    runs = sweep.plan(Config(), ["sim.speeds=[],[1,1,0.5,0.5]", "outer.sync_every=5,10"],
                      ["ddp"], [0, 3])  # fmt: skip
    names = [name for name, _, _ in runs]
    assert names[:2] == ["speeds=[],sync_every=5,seed=0", "speeds=[],sync_every=5,seed=3"]
    assert "speeds=[1,1,0.5,0.5],sync_every=10,seed=3" in names and "ddp,seed=0" in names
    speeds = {(cfg.sim.speeds, cfg.outer.sync_every, cfg.seed) for _, _, cfg in runs[:8]}
    assert len(speeds) == 8 and ("1,1,0.5,0.5", 10, 3) in speeds and ("", 5, 0) in speeds
    assert all(cfg.parallel.runtime == "sim" for _, _, cfg in runs)
    # a value that is not wholly bracketed is taken as written (TFDS split slices)
    assert sweep.parse_sweep("data.train_split=train[:90%],train")[1] == ["train[:90%]", "train"]
    with pytest.raises(ConfigError, match="needs 4 positive numbers"):
        sweep.plan(Config(), ["sim.speeds=[1,0.5]"], [], [0])


@pytest.mark.parametrize(
    "sweeps,match",
    [(["outer.sync_every=,"], "an empty value"), (["outer.sync_every="], "use KEY=V1,V2"),
     (["=1,2"], "use KEY=V1,V2"), (["outer.sync_every"], "use KEY=V1,V2"),
     (["bogus.key=1"], "unknown config key 'bogus.key'"),
     (["outer.sync_evry=1"], "did you mean outer.sync_every"),
     (["outer.sync_every=1,1"], "'1' is listed twice"),
     (["outer.sync_every=1", "outer.sync_every=2"], "swept twice"),
     (["sim.speeds=[1,1"], r"unbalanced \[ \]"), (["sim.speeds=1]"], r"unbalanced \[ \]"),
     (["seed=1,2"], "use --seeds"), (["outer.sync_every=x"], "'x' is not a valid int"),
     (["outer.sync_every=5,0"], "outer.sync_every = 0 is invalid")],
)  # fmt: skip
def test_sweep_plan_refuses_bad_specs_in_one_line(sweeps, match):
    from sim import sweep

    with pytest.raises(ConfigError, match=match) as e:
        sweep.plan(Config(), sweeps, [], [0])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "flags,match",
    [(["--seeds", "0,x"], "--seeds: 'x' is not an integer"), (["--seeds", "0,,1"], "empty item"),
     (["--seeds", ""], "empty item"), (["--seeds", "-1"], "'-1' is not an integer in"),
     (["--seeds", str(2**31)], "is not an integer in"), (["--seeds", "1,1"], "listed twice"),
     (["--baselines", "ddp,"], "--baselines 'ddp,': an empty item"),
     (["--sweep", "outer.sync_every=,"], "an empty value"),
     (["--workdir", "FILE/sub"], "--workdir .*: parent .* is a file")],
)  # fmt: skip
def test_sweep_cli_refuses_before_anything_is_written(tmp_path, capsys, flags, match):
    from sim.__main__ import main

    (tmp_path / "FILE").write_text("")
    flags = [f.replace("FILE", str(tmp_path / "FILE")) for f in flags]
    workdir = ["--workdir", str(tmp_path / "w")] if "--workdir" not in flags else []
    try:
        code = main(["--config", "tiny", *workdir, *flags])
    except SystemExit as e:  # cli.parse exits
        code = e.code
    assert code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and __import__("re").search(match, line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def test_sweep_bad_value_fails_before_training(tmp_path, capsys):
    from sim.__main__ import main

    code = main(["--config", "configs/tiny.py", "--workdir", str(tmp_path),
                 "--sweep", "outer.sync_every=5,0"])  # fmt: skip
    assert code == 2
    assert "outer.sync_every = 0 is invalid" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_combine_sweeps_into_one_table_and_figure(tmp_path):
    from sim import combine
    from sim.sweep import write_csv

    base = {"seeds": 1, "replicas": 4, "sync_every": 50, "outer_lr": 0.7, "tokens": 100,
            "final_eval_loss_std": 0.0, "best_eval_loss": 1.0, "sim_wallclock_s": 2.0,
            "utilization": 0.9, "peak_sync_bytes": 1e5}  # fmt: skip
    (tmp_path / "codecs").mkdir()
    write_csv(tmp_path / "codecs" / "summary.csv", [
        {**base, "run": "compress.codec=int8", "codec": "int8", "final_eval_loss": 1.9,
         "bytes_per_replica": 5e6, "bytes_vs_ddp": 0.005},
        {**base, "run": "compress.codec=none", "codec": "none", "final_eval_loss": 1.8,
         "bytes_per_replica": 2e7, "bytes_vs_ddp": 0.02},
    ])  # fmt: skip
    (tmp_path / "baselines").mkdir()
    write_csv(tmp_path / "baselines" / "summary.csv", [
        {**base, "run": "single", "codec": "none", "final_eval_loss": 2.0,
         "bytes_per_replica": 0.0, "bytes_vs_ddp": 0.0},
    ])  # fmt: skip
    out = tmp_path / "out"
    assert combine.main([str(tmp_path / "codecs"), str(tmp_path / "baselines"), "--out",
                         str(out)]) == 0  # fmt: skip
    rows = (out / "table.md").read_text().splitlines()[2:]
    # sorted by bytes; runs named by their sweep
    assert [r.split(" | ")[0] for r in rows] == [
        "| baselines: single",
        "| codecs: compress.codec=int8",
        "| codecs: compress.codec=none",
    ]
    assert "| 1.900 | 5e+06 | 0.005 | 1e+05 |" in rows[1]
    assert (out / "tradeoff.png").stat().st_size > 10_000
    assert combine.main([str(tmp_path / "missing"), "--out", str(out)]) == 2


def test_combine_replots_from_rows_json_without_the_sweeps(tmp_path, capsys):
    import json
    import shutil

    from sim import combine
    from sim.sweep import write_csv

    base = {"seeds": 3, "replicas": 4, "sync_every": 50, "outer_lr": 0.7, "tokens": 100,
            "best_eval_loss": 1.0, "sim_wallclock_s": 2.0, "utilization": 0.9,
            "peak_sync_bytes": 1e5, "bytes_vs_ddp": 0.02}  # fmt: skip
    for sweep, loss in (("diloco", 1.87), ("muloco", 1.86)):
        (tmp_path / sweep).mkdir()
        write_csv(tmp_path / sweep / "summary.csv", [
            {**base, "run": "diloco", "codec": "none", "final_eval_loss": loss,
             "final_eval_loss_std": 0.007, "bytes_per_replica": 2e7},
            {**base, "run": "single", "codec": "none", "final_eval_loss": 1.98, "seeds": 1,
             "final_eval_loss_std": 0.0, "bytes_per_replica": 0.0, "peak_sync_bytes": 0.0},
        ])  # fmt: skip
    out = tmp_path / "out"
    argv = [str(tmp_path / "diloco"), str(tmp_path / "muloco"), "--out", str(out), "--title", "T"]
    assert combine.main(argv) == 0
    table = (out / "table.md").read_text()
    saved = json.loads((out / "rows.json").read_text())
    assert saved["title"] == "T" and [r["run"] for r in saved["rows"]] == [
        "diloco: diloco", "diloco: single", "muloco: diloco", "muloco: single"]  # fmt: skip
    shutil.rmtree(tmp_path / "diloco")
    shutil.rmtree(tmp_path / "muloco")
    (out / "table.md").unlink()
    (out / "tradeoff.png").unlink()
    capsys.readouterr()
    assert combine.main(["--replot", str(out)]) == 0
    assert (out / "table.md").read_text() == table == capsys.readouterr().out
    assert (out / "tradeoff.png").stat().st_size > 10_000
    assert json.loads((out / "rows.json").read_text()) == saved  # the title kept
    # --replot alone: no sweeps, no --out; a rows.json that is not combine's is refused
    assert combine.main(["--replot", str(out), str(tmp_path / "x")]) == 2
    assert combine.main(["--replot", str(out), "--out", str(out)]) == 2
    assert combine.main([str(tmp_path / "x")]) == 2
    (out / "rows.json").write_text('{"rows": [{"run": "x"}], "title": ""}')
    assert combine.main(["--replot", str(out)]) == 2
    assert "is not a rows.json" in capsys.readouterr().err


# combined runs as sim.combine reads them: baselines, families of one run and of several
_COMBINED = [{"run": f"{family}: {name}", "final_eval_loss": loss, "bytes_per_replica": b,
              "peak_sync_bytes": b / 8, "seeds": 1.0, "final_eval_loss_std": 0.0}
             for family, name, loss, b in [
                 ("baselines", "single", 1.98, 0.0), ("baselines", "ddp", 1.79, 1e9),
                 ("muloco", "diloco", 1.863, 2.29e7), ("diloco", "diloco", 1.872, 2.29e7),
                 ("dylu", "diloco", 1.876, 2.29e7), ("wait", "diloco", 1.872, 2.29e7),
                 ("adam", "learning_rate=0.01", 2.09, 2.29e7),
                 ("adam", "learning_rate=0.03", 2.10, 2.29e7),
                 ("codecs", "codec=int4", 1.866, 3e6)]]  # fmt: skip


def test_tradeoff_labels_name_the_method_and_do_not_overlap(tmp_path, monkeypatch):
    from matplotlib.text import Text

    from sim import plots

    rows = _COMBINED
    assert plots.point_labels(rows) == {
        "baselines: single": "single", "baselines: ddp": "ddp", "muloco: diloco": "muloco",
        "diloco: diloco": "diloco", "dylu: diloco": "dylu", "wait: diloco": "wait",
        "adam: learning_rate=0.01": "adam: lr=0.01", "adam: learning_rate=0.03": "adam: lr=0.03",
        "codecs: codec=int4": "codecs",
    }  # fmt: skip
    boxes = []
    real_savefig = plots.pyplot().Figure.savefig

    def savefig(fig, path, **kwargs):  # the labels' boxes in the final layout
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            boxes.append([Text.get_window_extent(t, renderer) for t in ax.texts])  # no leader
        return real_savefig(fig, path, **kwargs)

    monkeypatch.setattr(plots.pyplot().Figure, "savefig", savefig)
    plots.tradeoff_two_panels(rows, tmp_path / "t.png")
    plots.tradeoff(rows, tmp_path / "one.png")
    assert [len(b) for b in boxes] == [9, 7, 9]  # a label per point and per line
    for panel in boxes:
        for i, a in enumerate(panel):
            assert not any(a.overlaps(b) for b in panel[i + 1 :]), [t.bounds for t in panel]


def test_the_sweeps_figures_read_at_9_pt_with_a_log_axis_for_a_loss_spanning_decades(
    tmp_path, monkeypatch
):
    """Drawn at the docs column's width, every text (ticks and legends too) shows at 9 pt or
    more; a loss that spans decades is drawn on a log axis (its end is not a flat line), one
    within a decade on a linear one; the axis says what the user calls the loss."""
    from sim import plots
    from tests.test_drawing import drawn_figures, smallest_shown_pt

    figs = drawn_figures(monkeypatch)

    def run(loss):
        return {"tokens": [0, 640, 1280], "steps": [0, 10, 20], "loss": loss, "seeds": 3,
                "low": [0.9 * v for v in loss], "high": [1.1 * v for v in loss]}  # fmt: skip

    spanning = {"sync_every=10": run([0.75, 0.02, 0.003]), "single": run([0.75, 0.1, 0.05])}
    plots.curves(spanning, tmp_path / "mse.png", unit="example", nats=False,
                 label="validation MSE")  # fmt: skip
    plots.curves({"diloco": run([3.1, 2.2, 1.9])}, tmp_path / "lm.png")
    plots.tradeoff(_COMBINED, tmp_path / "tradeoff.png")
    plots.tradeoff_two_panels(_COMBINED, tmp_path / "two.png")
    assert [ax.get_yscale() for ax in figs[0].axes + figs[1].axes] == ["log"] * 2 + ["linear"] * 2
    assert figs[0].axes[1].get_ylabel() == "validation MSE (log scale)"
    assert figs[1].axes[0].get_ylabel() == "validation loss (nats/token)"
    for fig in figs:
        assert fig.get_figwidth() <= plots.WIDTH and smallest_shown_pt(fig) >= 9


def test_the_sweeps_diagnostics_average_finite_replicas():
    from diloco_jax.watch.drawing import _nanmean_rows

    values_SxR = np.array([[1.0, 3.0, np.nan], [np.nan, np.nan, np.nan], [2.0, 2.0, 5.0]])
    np.testing.assert_array_equal(_nanmean_rows(values_SxR), [2.0, np.nan, 3.0])


def test_diagnostics_pad_a_replica_count_that_changed_within_a_run(tmp_path):
    """An elastic restart from 4 replicas to 2: the figure's replicas 2 and 3 end there."""
    from diloco_jax.watch.drawing import _rows
    from diloco_jax.watch.figures import run_diagnostics

    rows = _rows([[1.0, 2.0, 3.0, None], [4.0, 5.0]])
    np.testing.assert_array_equal(rows, [[1, 2, 3, np.nan], [4, 5, np.nan, np.nan]])
    events = [{"event": "sync", "step": 5 * k, "outer_step": k, "drift": [1.0] * r,
               "cosine_to_mean": [0.5] * r} for k, r in ((1, 4), (2, 2))]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert run_diagnostics(tmp_path) == ["drift.png", "cosine.png"]
    (tmp_path / "metrics.jsonl").write_text('{"event": "sync", "outer_step": 1}\n')  # no drift
    assert run_diagnostics(tmp_path) == []  # a warning, not an error
