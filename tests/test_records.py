"""What a run records: per-replica TensorBoard series, hparams, the run record, the progress bar's
switches and the Weights & Biases writer (offline)."""

import json
import pathlib
import struct
import subprocess

import pytest

from diloco_jax import config as config_lib
from diloco_jax import records, reporting
from diloco_jax.train import train
from tests.test_train import tiny

REPO = pathlib.Path(__file__).resolve().parent.parent
BAR = "step/s"  # in every tqdm bar of train's (unit "step")


def tf_events(workdir: pathlib.Path) -> list:
    """Every event of ``workdir/tensorboard`` (TFRecord framing: length, its crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted((workdir / "tensorboard").glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            events.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + n]))
            i += 12 + n + 4
    return events


def tags(events) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for event in events:
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_scalars_one_series_per_replica():
    record = {"event": "sync", "step": 5, "time_s": 0.5, "outer_step": 1, "drift": [0.5, 0.25],
              "finite": [True, False], "unit": "token", "none": None, "nest": [[1.0]]}  # fmt: skip
    assert reporting.scalars(record) == {
        "sync/time_s": 0.5, "sync/outer_step": 1.0, "sync/drift/replica_0": 0.5,
        "sync/drift/replica_1": 0.25, "sync/finite/replica_0": 1.0, "sync/finite/replica_1": 0.0,
    }  # fmt: skip


def test_progress_bar_switches(capsys, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    for enabled in (True, False):
        bar = reporting.progress_bar(4, enabled=enabled)
        bar.update(4)
        bar.close()
        assert (BAR in capsys.readouterr().err) == enabled
    for value, off in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("TQDM_DISABLE", value)
        bar = reporting.progress_bar(4)
        bar.update(4)
        bar.close()
        assert (BAR in capsys.readouterr().err) != off, value


def test_git_state(tmp_path):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert records.git_state()["commit"] == head
    assert records.git_state(tmp_path / "diloco_jax") is None  # not a checkout
    # a package inside some other repository (a wheel in a .venv of a checkout) is no checkout
    assert records.git_state(REPO / "tests" / "diloco_jax") is None


def test_log_keys_are_validated(monkeypatch):
    with pytest.raises(config_lib.ConfigError, match="log.wandb_mode = 'cloud' is invalid"):
        config_lib.validate(tiny(**{"log.wandb_mode": "cloud"}))
    monkeypatch.setattr(config_lib.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(config_lib.ConfigError, match=r"log.wandb = True .*diloco-jax\[wandb\]"):
        config_lib.validate(tiny(**{"log.wandb": "true"}))


def test_run_records_tensorboard_and_resume(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    cfg = tiny(**{"parallel.runtime": "sim", "train.total_steps": 10, "train.sample_chars": 0,
                  "log.progress_bar": "false"})  # fmt: skip
    train(cfg, tmp_path)  # show_progress defaults to True: the key turns the bar off
    assert BAR not in capsys.readouterr().err
    series = tags(tf_events(tmp_path))
    for r in range(4):
        assert [s for s, _ in series[f"sync/drift/replica_{r}"]] == [5, 10]
        assert [s for s, _ in series[f"train/replica_loss/replica_{r}"]] == [5, 10]
    [loss] = [v for s, v in series["train/loss"] if s == 10]
    events = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    [last] = [e for e in events if (e["event"], e["step"]) == ("train", 10)]
    assert loss == pytest.approx(last["loss"])
    assert [v for s, v in series["train/replica_loss/replica_2"] if s == 10] == pytest.approx(
        [last["replica_loss"][2]]
    )
    _check_hparams(tf_events(tmp_path), sync_every=5)

    [first] = _records(tmp_path)
    assert first["step"] == 0 and first["git"]["commit"] and isinstance(first["git"]["dirty"], bool)
    assert first["packages"]["jax"] and first["packages"]["diloco-jax"] == "0.1.0"
    assert first["devices"]["platform"] == "cpu" and first["devices"]["count"] == 8
    assert first["devices"]["process_count"] == 1 and first["command"] and first["hostname"]

    monkeypatch.setenv("TQDM_DISABLE", "1")
    resumed = config_lib.apply_overrides(cfg, [("train.total_steps", "15"),
                                               ("log.progress_bar", "true")])  # fmt: skip
    train(resumed, tmp_path, allow_config_change=True)  # total_steps changes the schedule
    assert BAR not in capsys.readouterr().err
    assert [r["step"] for r in _records(tmp_path)] == [0, 10]
    _check_hparams(tf_events(tmp_path), sync_every=5)  # once: the first start's
    assert [s for s, _ in tags(tf_events(tmp_path))["sync/drift/replica_3"]] == [5, 10, 15]


def _records(workdir):
    return [json.loads(line) for line in (workdir / "run_record.jsonl").read_text().splitlines()]


def _check_hparams(events, *, sync_every):
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData

    starts = [HParamsPluginData.FromString(v.metadata.plugin_data.content).session_start_info
              for e in events for v in e.summary.value
              if v.tag == "_hparams_/session_start_info"]  # fmt: skip
    assert len(starts) == 1
    hparams = starts[0].hparams
    assert hparams["outer.sync_every"].number_value == sync_every
    assert hparams["algorithm"].string_value == "diloco"
    assert hparams["log.progress_bar"].bool_value is False
    experiment = [e for e in events for v in e.summary.value if v.tag == "_hparams_/experiment"]
    assert len(experiment) == 1


def wandb_records(run: pathlib.Path) -> tuple[list[dict], dict]:
    """The history rows and the config of an offline W&B run, read from its ``run-*.wandb``
    file: wandb's LevelDB-style log (a 7-byte header, then records of crc32, length and type in
    32 KiB blocks; type 1 whole, 2-4 first, middle, last piece) of ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    def plain(items):
        return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}

    [path] = run.glob("run-*.wandb")
    data, i, piece, rows, config = path.read_bytes(), 7, b"", [], {}
    while i + 7 <= len(data):
        left = 32768 - i % 32768
        length, kind = struct.unpack("<HB", data[i + 4 : i + 7])
        if left < 7 or kind == 0:  # the rest of the block is padding
            i += left
            continue
        piece, i = piece + data[i + 7 : i + 7 + length], i + 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record.FromString(piece)
            what = record.WhichOneof("record_type")
            if what == "history":
                rows.append(plain(record.history.item))
            elif what in ("run", "config"):  # the config comes with the run, updates later
                config.update(plain((record.run.config if what == "run" else record.config).update))
            piece = b""
    return rows, config


@pytest.fixture
def offline_wandb(monkeypatch):
    pytest.importorskip("wandb")  # in the dev group; the extra diloco-jax[wandb] for users
    monkeypatch.setenv("WANDB_MODE", "online")  # log.wandb_mode wins: nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_wandb_writer_offline(tmp_path, offline_wandb):
    writer = reporting.WandbWriter(tmp_path, project="test", mode="offline",
                                   config={"outer": {"sync_every": 5}})  # fmt: skip
    runlog = reporting.RunLog(tmp_path, sinks=(writer,))
    events = [("sync", 5, {"drift": [0.5, 0.25], "outer_step": 1}),
              ("train", 5, {"loss": 2.0, "replica_loss": [1.5, 2.5]}),
              ("eval", 10, {"eval_loss": 1.75, "unit": "token"})]  # fmt: skip
    for event, step, values in events:
        runlog.write(event, step, **values)
    runlog.close()
    [run] = (tmp_path / "wandb").glob("offline-run-*")
    rows, config = wandb_records(run)
    assert config["outer"] == {"sync_every": 5}
    by_step = {row["_step"]: row for row in rows}
    logged = {k: v for k, v in by_step[5].items() if not k.startswith("_") and "time" not in k}
    assert logged == {
        "sync/drift/replica_0": 0.5, "sync/drift/replica_1": 0.25, "sync/outer_step": 1,
        "train/loss": 2.0, "train/replica_loss/replica_0": 1.5, "train/replica_loss/replica_1": 2.5,
    }  # fmt: skip
    assert by_step[10]["eval/eval_loss"] == 1.75 and "eval/unit" not in by_step[10]


@pytest.mark.slow  # trains (about 40 s on 2 busy cores); test_wandb_writer_offline stays
def test_wandb_logs_a_training_run(tmp_path, offline_wandb):
    cfg = tiny(**{"parallel.runtime": "sim", "train.total_steps": 10, "train.sample_chars": 0,
                  "log.wandb": "true"})  # fmt: skip
    train(cfg, tmp_path, show_progress=False)
    [run] = (tmp_path / "wandb").glob("offline-run-*")
    rows, config = wandb_records(run)
    assert config["outer"]["sync_every"] == 5
    by_step = {row["_step"]: row for row in rows}
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for event in events:  # every event's numbers at its step, a per-replica list as R series
        expected = reporting.scalars(event)
        assert {k: by_step[event["step"]][k] for k in expected} == pytest.approx(expected)
    assert by_step[10]["sync/drift/replica_3"] == pytest.approx(events[2]["drift"][3])
