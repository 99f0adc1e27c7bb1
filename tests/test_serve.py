"""The run's HTTP view and control (issue 16): the board against hand-fed events, the server's
answers (status, metrics, dashboard, 401, 400, 413, 404) in process, a stalled client, and a live
tiny run steered over HTTP (eval, checkpoint, stop with exit 0 and a checkpoint): the command's
main in this process by default, the command in a child process in the slow set."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from diloco_jax.config import ConfigError, apply_overrides, load_preset, validate
from diloco_jax.watch import serve

TOKEN = "s3cret-token"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _board():
    board = serve.Board(config={"outer": {"sync_every": 5}}, total_steps=100, replicas=2,
                        unit="token", tokens_per_step=64, bytes_per_sync=10.0)  # fmt: skip
    board.event({"event": "train", "step": 10, "loss": 2.0, "replica_loss": [2.1, 1.9],
                 "tokens_per_s": 128.0, "outer_steps": 2, "aux_mae": 0.25})  # fmt: skip
    for step, outer in ((5, 1), (10, 2)):
        board.event({"event": "sync", "step": step, "outer_step": outer, "drift": [0.1, 0.3],
                     "cosine_to_mean": [0.9, float("nan")], "weight": [1.0, 0.0],
                     "finite": [True, False], "contributors": 1.0})  # fmt: skip
    board.event({"event": "eval", "step": 10, "time_s": 3.0, "time": 1.8e9, "eval_loss": 1.5,
                 "outer_steps": 2, "tokens": 640, "accuracy": 0.75})  # fmt: skip
    board.event({"event": "checkpoint", "step": 10})
    return board


def test_the_board_holds_what_the_run_reported():
    status = _board().snapshot({"stop": True})
    assert (status["step"], status["outer_step"], status["tokens"]) == (10, 2, 640)
    assert (status["train_loss"], status["eval_loss"], status["last_checkpoint"]) == (2.0, 1.5, 10)
    assert status["bytes_sent_per_replica"] == 20.0  # two syncs of 10 bytes
    assert status["eta_s"] == pytest.approx(90 / 2.0)  # 90 steps left at 128 / 64 steps/s
    assert [r["status"] for r in status["replica_state"]] == ["contributed", "non-finite"]
    assert status["replica_loss"] == [2.1, 1.9] and status["pending_controls"] == ["stop"]
    assert status["config"]["outer"]["sync_every"] == 5
    # a user loss's auxiliary metrics and the evaluation's other values (issue 27), not the
    # record's bookkeeping (its Unix time, seconds, outer steps, tokens: issue 54)
    assert status["aux"] == {"mae": 0.25} and status["eval_metrics"] == {"accuracy": 0.75}


def test_a_resumed_runs_board_starts_with_its_earlier_history(tmp_path):
    """The events of ``metrics.jsonl`` up to the resumed step are replayed (those the run
    wrote past its checkpoint before it died are not: it writes them again), aux and eval
    metrics included, so the charts start where the run started (issue 39)."""
    import json

    events = [{"event": "train", "step": s, "loss": 3.0 - s / 10, "replica_loss": [3.0, 3.0],
               "tokens_per_s": 100.0, "outer_steps": s // 5, "aux_mae": s / 100}
              for s in (5, 10, 15)]  # fmt: skip
    events += [{"event": "eval", "step": 10, "eval_loss": 2.0, "accuracy": 0.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "tr')  # cut
    board = serve.Board(config={}, total_steps=100, replicas=2, unit="example",
                        tokens_per_step=8)  # fmt: skip
    assert board.replay(path, up_to=10) == 3
    history = board.history
    assert [p[0] for p in history["train"]] == [5, 10]
    assert [p[0] for p in history["eval"]] == [10]
    assert [p[2] for p in history["metrics"]] == [{"train mae": 0.05}, {"train mae": 0.1},
                                                  {"eval accuracy": 0.5}]  # fmt: skip
    assert board.replay(tmp_path / "none.jsonl", up_to=10) == 0


def test_metrics_parse_with_prometheus_clients_parser():
    text = generate_latest(_board().registry).decode()
    families = text_string_to_metric_families(text)
    samples = {(s.name, s.labels.get("replica") or s.labels.get("name")): s.value
               for f in families for s in f.samples}  # fmt: skip
    assert samples[("diloco_syncs_total", None)] == 2
    assert samples[("diloco_sent_bytes_total", None)] == 20
    assert samples[("diloco_tokens_total", None)] == 640
    assert samples[("diloco_checkpoints_total", None)] == 1
    assert samples[("diloco_eval_loss", None)] == 1.5
    assert samples[("diloco_replica_drift", "1")] == 0.3
    assert samples[("diloco_replica_train_loss", "0")] == 2.1
    assert samples[("diloco_aux_metric", "mae")] == 0.25
    assert samples[("diloco_eval_metric", "accuracy")] == 0.75
    assert {name for metric, name in samples if metric == "diloco_eval_metric"} == {"accuracy"}


@pytest.fixture
def server():
    controls = serve.Controls()
    srv = serve.Server("127.0.0.1", 0, board=_board(), controls=controls, token=TOKEN)
    srv.start()
    yield srv
    srv.stop()


def _request(port, method, path, body=None, headers=None, timeout=10):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data


def _auth(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


def test_reads_are_open_on_loopback(server):
    code, body = _request(server.port, "GET", "/status")
    assert code == 200 and json.loads(body)["step"] == 10
    code, body = _request(server.port, "GET", "/history")
    history = json.loads(body)
    assert code == 200 and [p[0] for p in history["sync"]] == [1, 2]
    code, body = _request(server.port, "GET", "/")
    assert code == 200 and b"dashboard.js" in body and b"chart.js" in body
    code, body = _request(server.port, "GET", "/dashboard.js")
    assert code == 200 and b"render" in body
    code, body = _request(server.port, "GET", "/chart.js")  # the charts, shared with the syncer's
    assert code == 200 and b"polyline" in body
    code, body = _request(server.port, "GET", "/metrics")
    assert code == 200 and b"diloco_syncs_total 2.0" in body
    assert _request(server.port, "GET", "/nothing")[0] == 404


@pytest.mark.parametrize("headers,body,code", [
    ({}, "{}", 401),  # no token
    (_auth("wrong"), "{}", 401),
    (_auth(), "not json", 400),
    (_auth(), "[1, 2]", 400),
    (_auth(), "x" * (serve.MAX_BODY + 1), 413),
])  # fmt: skip
def test_bad_control_requests_change_nothing(server, headers, body, code):
    got, answer = _request(server.port, "POST", "/control/stop", body=body, headers=headers)
    assert got == code and json.loads(answer)["error"]
    assert server.controls.pending() == {}


def test_a_control_request_waits_for_the_next_boundary(server):
    assert _request(server.port, "POST", "/control/launch", "{}", _auth())[0] == 404
    code, body = _request(server.port, "POST", "/control/checkpoint", "", _auth())
    assert code == 202 and json.loads(body)["accepted"] == "checkpoint"
    assert json.loads(_request(server.port, "GET", "/status")[1])["pending_controls"] == [
        "checkpoint"]  # fmt: skip
    assert server.controls.take() == {"checkpoint": True} and server.controls.take() == {}


def test_a_stalled_client_does_not_hold_up_others_or_the_board(server):
    stalled = socket.create_connection(("127.0.0.1", server.port))
    stalled.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    try:
        start = time.perf_counter()
        assert _request(server.port, "GET", "/status", timeout=5)[0] == 200
        server.board.event({"event": "eval", "step": 20, "eval_loss": 1.25})
        assert time.perf_counter() - start < 5
        assert server.board.snapshot()["eval_loss"] == 1.25
    finally:
        stalled.close()


def test_another_address_needs_a_token_and_then_every_request_does(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs a token"):
        serve.Server("0.0.0.0", 0, board=_board(), controls=serve.Controls(), token="")
    srv = serve.Server("0.0.0.0", 0, board=_board(), controls=serve.Controls(), token=TOKEN)
    srv.start()
    try:
        assert _request(srv.port, "GET", "/status")[0] == 401
        assert _request(srv.port, "GET", "/status", headers=_auth())[0] == 200
    finally:
        srv.stop()
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    cfg = load_preset("tiny")
    with pytest.raises(ConfigError, match=r"serve.host = '0.0.0.0' is invalid: is not a loopback"):
        validate(apply_overrides(cfg, [("serve.port", "8080"), ("serve.host", "0.0.0.0")]))
    with pytest.raises(ConfigError, match=r"serve.port = 70000 is invalid"):
        validate(apply_overrides(cfg, [("serve.port", "70000")]))
    with pytest.raises(ConfigError, match=r"serve.token_file = .* must be a file"):
        validate(apply_overrides(cfg, [("serve.token_file", str(tmp_path / "none"))]))


def test_a_generated_token_is_private_to_the_user(tmp_path, monkeypatch):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    token, generated = serve.resolve_token("", tmp_path)
    path = tmp_path / "serve_token"
    assert generated and path.read_text().strip() == token and len(token) >= 24
    assert path.stat().st_mode & 0o777 == 0o600
    (tmp_path / "given").write_text("abc\n")
    assert serve.resolve_token(str(tmp_path / "given"), tmp_path) == ("abc", False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(port, proc, predicate, timeout=240):
    """Polls /status until ``predicate(status)``; returns the status."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            code, body = _request(port, "GET", "/status", timeout=5)
        except OSError:
            time.sleep(0.2)
            continue
        status = json.loads(body)
        if code == 200 and predicate(status):
            return status
        time.sleep(0.2)
    raise AssertionError("the run never reached the state waited for")


def _stop(port, proc) -> str:
    """Asks the run to stop over HTTP; its stdout, once it has exited with status 0."""
    assert _request(port, "POST", "/control/stop", "{}", _auth())[0] == 202
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return out


def _events(workdir) -> list[dict]:
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]


LIVE_FLAGS = ["--config", "tiny", "--config.train.total_steps=40000",
              "--config.train.eval_every=10000", "--config.train.sample_chars=0"]  # fmt: skip


def _steer(port, run, workdir) -> int:
    """A tiny run that would take 40000 steps: an eval and a checkpoint asked over HTTP happen at
    the next call boundary; an outer learning rate set over HTTP is logged; a stop ends the run
    there with a checkpoint. ``run``: the run, something with ``poll()`` and ``communicate()``
    (:func:`_stop`); returns the step it stopped at."""
    status = _wait_for(port, run, lambda s: s["step"] >= 10)
    assert status["state"] == "running" and len(status["replica_state"]) == 4
    for action in ("eval", "checkpoint"):
        assert _request(port, "POST", f"/control/{action}", "{}", _auth())[0] == 202
    status = _wait_for(port, run, lambda s: len(s["controls"]) == 2
                       and s["last_checkpoint"] is not None)  # fmt: skip
    done = {c["action"]: c["step"] for c in status["controls"]}
    assert status["last_checkpoint"] == done["checkpoint"] and done["eval"] % 10000 != 0
    assert _request(port, "POST", "/control/outer_lr", '{"value": 0.35}', _auth())[0] == 202
    _wait_for(port, run, lambda s: s["outer_lr"] == 0.35)
    out = _stop(port, run)
    assert "stopped by POST /control/stop" in out
    events = _events(workdir)
    controls = {a: e["step"] for e in events if e["event"] == "control" for a in e["actions"]}
    assert controls["eval"] == done["eval"] and controls["checkpoint"] == done["checkpoint"]
    assert done["eval"] in [e["step"] for e in events if e["event"] == "eval"]
    assert (workdir / "checkpoints" / str(done["checkpoint"])).is_dir()
    assert (workdir / "checkpoints" / str(controls["stop"])).is_dir() and controls["stop"] < 40000
    assert [e["outer_lr"] for e in events if "outer_lr" in e.get("actions", ())] == [0.35]
    return controls["stop"]


def _resumed(port, run, stopped: int) -> None:
    """The same command resumes at the stop with the outer learning rate set over HTTP."""
    status = _wait_for(port, run, lambda s: s["step"] > stopped)
    assert status["outer_lr"] == 0.35
    _stop(port, run)


class _InThisProcess:
    """``python -m diloco_jax.train``'s ``main(argv)`` run in this process's main thread (its
    signal handlers need it) while ``steer(self)`` runs in another thread and reads it as it
    would read a child process: :meth:`poll` is None until ``main`` returns, then its exit
    status; :meth:`communicate` waits for that and gives what it printed."""

    def __init__(self, argv, capsys, port):
        self.argv, self.capsys, self.port, self.returncode = argv, capsys, port, None
        self.ended = threading.Event()

    def poll(self):
        return self.returncode

    def communicate(self, timeout=None):
        assert self.ended.wait(timeout), "the run did not end"
        return self.out, self.err

    def run(self, steer):
        from diloco_jax.train import main

        failed = []

        def steering():
            try:
                steer(self)
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
                failed.append(e)
                with contextlib.suppress(OSError):  # the run ends at its next call boundary
                    _request(self.port, "POST", "/control/stop", "{}", _auth())

        thread = threading.Thread(target=steering, daemon=True)
        self.capsys.readouterr()
        thread.start()
        try:
            self.returncode = main(self.argv)
        finally:
            self.out, self.err = self.capsys.readouterr()
            self.ended.set()
            thread.join(timeout=60)
        if failed:
            raise failed[0]
        assert not thread.is_alive(), "the steering thread did not end"


def test_a_live_run_in_this_process_is_steered_over_http_and_resumes(tmp_path, capsys,
                                                                     monkeypatch):  # fmt: skip
    """The command's ``main`` in this process, steered over HTTP as the slow test below steers
    the command in a child process (:func:`_steer`: eval, checkpoint, outer learning rate, stop
    with a checkpoint and exit 0); the same arguments resume with that learning rate."""
    monkeypatch.setenv(serve.TOKEN_ENV, TOKEN)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    port, workdir = free_port(), tmp_path / "run"
    argv = [*LIVE_FLAGS, "--workdir", str(workdir), f"--config.serve.port={port}"]
    stopped = []
    run = _InThisProcess(argv, capsys, port)
    run.run(lambda r: stopped.append(_steer(port, r, workdir)))
    assert run.returncode == 0 and len(stopped) == 1
    again = _InThisProcess(argv, capsys, port)
    again.run(lambda r: _resumed(port, r, stopped[0]))
    assert again.returncode == 0


@pytest.mark.slow  # ~30 s alone, ~70 s in the suite: two commands, each importing JAX; the
# default suite's stand-in: the same steering of the command's main in this process (above)
def test_a_live_run_is_steered_over_http(tmp_path):
    """The command in a child process, steered over HTTP (:func:`_steer`): it exits 0 at the
    stop with a checkpoint; the same command resumes with the outer learning rate set."""
    port, workdir = free_port(), tmp_path / "run"
    env = {**os.environ, serve.TOKEN_ENV: TOKEN, "TQDM_DISABLE": "1"}
    command = [sys.executable, "-m", "diloco_jax.train", *LIVE_FLAGS, "--workdir", str(workdir),
               f"--config.serve.port={port}"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        stopped = _steer(port, proc, workdir)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _resumed(port, proc, stopped)
    finally:
        if proc.poll() is None:
            proc.kill()


BAD_VALUES = ["{}", '{"value": -1}', '{"value": 0}', '{"value": NaN}', '{"value": Infinity}',
              '{"value": true}', '{"value": "0.3"}']  # fmt: skip


@pytest.mark.parametrize("body", BAD_VALUES)
def test_a_bad_outer_learning_rate_is_400_and_changes_nothing(body):
    board = serve.Board(config={}, total_steps=10, replicas=2, unit="token", tokens_per_step=1,
                        outer_lr=0.7)  # fmt: skip
    srv = serve.Server("127.0.0.1", 0, board=board, controls=serve.Controls(), token=TOKEN)
    srv.start()
    try:
        code, answer = _request(srv.port, "POST", "/control/outer_lr", body, _auth())
        assert code == 400 and "finite number > 0" in json.loads(answer)["error"]
        assert srv.controls.pending() == {}
        code, _ = _request(srv.port, "POST", "/control/outer_lr", '{"value": 0.35}', _auth())
        assert code == 202 and srv.controls.take() == {"outer_lr": 0.35}
    finally:
        srv.stop()


def test_a_run_without_an_outer_optimizer_refuses_an_outer_learning_rate(server):
    code, answer = _request(server.port, "POST", "/control/outer_lr", '{"value": 1}', _auth())
    assert code == 400 and "no outer learning rate" in json.loads(answer)["error"]


def test_an_outer_scale_is_the_outer_learning_rate_changed_between_syncs():
    """Outer Nesterov at lr 0.7 with the update scaled by 0.5 from the second sync on equals
    optax's own Nesterov whose learning rate drops from 0.7 to 0.35 there."""
    import numpy as np
    import optax

    from diloco_jax.algorithm import diloco
    from tests import helpers
    from tests.test_diloco import CENTERS_RxD

    control = {"outer_scale": np.ones((6, 2), np.float32)}
    control["outer_scale"][2:] = 0.5  # the second and third syncs (after steps 4 and 6)
    scaled = diloco(optax.sgd(0.1), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=2)
    drop = optax.sgd(optax.piecewise_constant_schedule(0.7, {1: 0.5}), momentum=0.9,
                     nesterov=True)  # fmt: skip
    x0 = np.zeros(2, np.float32)
    got, _, _ = helpers.run_vmapped(scaled, x0, CENTERS_RxD, 6, control=control)
    want, _, _ = helpers.run_vmapped(diloco(optax.sgd(0.1), drop, sync_every=2), x0,
                                     CENTERS_RxD, 6)  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    plain, _, _ = helpers.run_vmapped(scaled, x0, CENTERS_RxD, 6)
    assert np.abs(plain[-1] - got[-1]).max() > 1e-3


@pytest.mark.slow  # ~30 s: a sweep in its own process; by default test_sim's sweep (in-process)
# reads the same /status over HTTP as each run starts (around faked runs; their training:
# test_user_task's sweep)
def test_a_sweep_serves_its_runs_and_table_so_far(tmp_path):
    """``python -m sim`` with serve.port: one server for the whole sweep; while the second run
    trains, /status is that run's, with the first run done and its table row."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim", "--config", "tiny", "--workdir", str(tmp_path),
         "--sweep", "outer.learning_rate=0.5,0.7", f"--config.serve.port={port}",
         "--config.train.total_steps=100", "--config.train.sample_chars=0",
         "--config.train.checkpoint=false"],
        cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # the second run's board, once it trains (its own config; the first run's step, loaded)
        status = _wait_for(port, proc, lambda s: s["config"]["outer"]["learning_rate"] == 0.7
                           and s["step"] > 0)  # fmt: skip
    finally:
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    first, second = status["sweep"]["runs"]
    assert first["state"] == "done" and first["final_eval_loss"] is not None
    assert [row["run"] for row in status["sweep"]["table"]] == [first["run"]]
    assert second["state"] == "running" and status["state"] == "running"
    assert "| learning_rate=0.7 |" in out


@pytest.mark.slow  # ~60 s; the default suite keeps the one-process live run (in this process)
def test_two_processes_agree_on_every_action_asked_of_process_0(tmp_path):
    """Process 0 serves; both processes change the outer learning rate and stop at the step it
    broadcasts: a difference would fail the anchor's cross-device check (exit 1) or hang the
    collective checkpoint, so exit 0 with the checkpoint at that step shows the agreement."""
    from tests.test_multiprocess import launch

    port, workdir = free_port(), tmp_path / "run"
    proc = launch(workdir, extra=[f"--config.serve.port={port}",
                                  "--config.train.total_steps=40000",
                                  "--config.train.checkpoint_every=0"],
                  env={**os.environ, serve.TOKEN_ENV: TOKEN})  # fmt: skip
    try:
        _wait_for(port, proc, lambda s: s["step"] >= 10)
        assert _request(port, "POST", "/control/outer_lr", '{"value": 0.5}', _auth())[0] == 202
        status = _wait_for(port, proc, lambda s: s["outer_lr"] == 0.5)
        _wait_for(port, proc, lambda s: s["outer_step"] > status["outer_step"] + 2)
        _stop(port, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    stop = [e["step"] for e in _events(workdir) if "stop" in e.get("actions", ())]
    assert len(stop) == 1 and (workdir / "checkpoints" / str(stop[0])).is_dir()


def test_a_port_in_use_is_a_one_line_error(tmp_path, monkeypatch):
    from diloco_jax.run.live import bind

    monkeypatch.setenv(serve.TOKEN_ENV, TOKEN)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = apply_overrides(load_preset("tiny"), [("serve.port", str(port))])
        with pytest.raises(ConfigError, match=rf"serve.port = {port} is invalid: cannot serve"):
            bind(cfg, _board(), serve.Controls(), TOKEN)
