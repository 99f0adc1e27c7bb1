"""What a run records: per-replica series, the run record's git commit, the progress bar's switches,
the log keys and the Weights & Biases writer (offline). A training run's TensorBoard series,
hparams and run records (and the progress bar key): ``tests/test_train.py``."""

import importlib.util
import json
import pathlib
import struct
import subprocess
import time

import pytest

from diloco_jax import config as config_lib
from diloco_jax.base import progress
from diloco_jax.train import train
from diloco_jax.watch import records, reporting
from tests.helpers import BAR
from tests.test_train import tiny

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_scalars_one_series_per_replica():
    # the Unix time is no series (float32 holds it to 2 minutes)
    record = {"event": "sync", "step": 5, "time_s": 0.5, "time": 1.8e9, "outer_step": 1,
              "drift": [0.5, 0.25],
              "finite": [True, False], "unit": "token", "none": None, "nest": [[1.0]]}  # fmt: skip
    assert reporting.scalars(record) == {
        "sync/time_s": 0.5, "sync/outer_step": 1.0, "sync/drift/replica_0": 0.5,
        "sync/drift/replica_1": 0.25, "sync/finite/replica_0": 1.0, "sync/finite/replica_1": 0.0,
    }  # fmt: skip


def test_progress_bar_switches(capsys, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    for enabled in (True, False):
        bar = progress.progress_bar(4, enabled=enabled)
        bar.update(4)
        bar.close()
        assert (BAR in capsys.readouterr().err) == enabled
    for value, off in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("TQDM_DISABLE", value)
        bar = progress.progress_bar(4)
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
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(config_lib.ConfigError, match=r"log.wandb = True .*--extra wandb"):
        config_lib.validate(tiny(**{"log.wandb": "true"}))


def wandb_records(run: pathlib.Path) -> tuple[list[dict], dict, bool]:
    """The history rows, the config and whether the run's exit record is there, of an offline
    W&B run, read from its ``run-*.wandb``
    file: wandb's LevelDB-style log (a 7-byte header, then records of crc32, length and type in
    32 KiB blocks; type 1 whole, 2-4 first, middle, last piece) of ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2

    def plain(items):
        return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}

    [path] = run.glob("run-*.wandb")
    data, i, piece, rows, config, done = path.read_bytes(), 7, b"", [], {}, False
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
            done = done or what == "exit"
            if what == "history":
                rows.append(plain(record.history.item))
            elif what in ("run", "config"):  # the config comes with the run, updates later
                config.update(plain((record.run.config if what == "run" else record.config).update))
            piece = b""
    return rows, config, done


def _when_written(run: pathlib.Path, timeout_s: float = 60) -> tuple[list[dict], dict]:
    """:func:`wandb_records`' rows and config once the run's exit record is in its file.
    wandb's service process may still be writing it when ``finish()`` returns (seen in CI under
    load: the file read back empty, and held every record moments later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rows, config, done = wandb_records(run)
        except Exception:  # noqa: BLE001 - not there yet, or a record half written
            if time.monotonic() > deadline:
                raise
            rows, config, done = [], {}, False
        if done or time.monotonic() > deadline:
            return rows, config
        time.sleep(0.5)


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
    rows, config = _when_written(run)
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
    rows, config = _when_written(run)
    assert config["outer"]["sync_every"] == 5
    by_step = {row["_step"]: row for row in rows}
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for event in events:  # every event's numbers at its step, a per-replica list as R series
        expected = reporting.scalars(event)
        assert {k: by_step[event["step"]][k] for k in expected} == pytest.approx(expected)
    assert by_step[10]["sync/drift/replica_3"] == pytest.approx(events[2]["drift"][3])
