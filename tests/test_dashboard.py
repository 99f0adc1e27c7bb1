"""The dashboard in a real headless browser (Debian's chromium): its charts hold the run's data
points and its replica table the last sync's rows (issue 16). Skipped, with the reason, where no
browser is installed; .ci/run installs one."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from diloco_jax.watch import serve

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    BROWSER is None, reason="no headless browser: apt-get install chromium to test the dashboard"
)


def headless(url: str, tmp_path, *flags: str) -> str:
    """``chromium --headless`` on ``url`` with ``flags`` after 5 s of the page's own time
    (its fetches and timers run); returns stdout."""
    done = subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
         f"--user-data-dir={tmp_path / 'profile'}", *flags, url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.stdout


def _board(replicas=3, steps=30, syncs=5):
    board = serve.Board(config={"algorithm": "diloco"}, total_steps=100, replicas=replicas,
                        unit="token", tokens_per_step=64)  # fmt: skip
    for i in range(1, steps + 1):  # a loss that spans decades
        board.event({"event": "train", "step": i, "loss": 3.0 * 0.85**i,
                     "replica_loss": [3.0 * 0.85**i + r / 10 for r in range(replicas)],
                     "tokens_per_s": 1000.0 + i, "outer_steps": i // 6,
                     "aux_mae": 0.01 * i})  # fmt: skip
        if i % 10 == 0:  # with the record's bookkeeping, which is no metric
            board.event({"event": "eval", "step": i, "eval_loss": 3.1 * 0.85**i,
                         "accuracy": 0.02 * i, "time": 1.8e9 + i, "time_s": 0.1 * i,
                         "outer_steps": i // 6, "tokens": 64 * i})  # fmt: skip
    for k in range(1, syncs + 1):
        board.event({"event": "sync", "step": 6 * k, "outer_step": k,
                     "drift": [0.1 * k + r for r in range(replicas)],
                     "cosine_to_mean": [0.5] * replicas, "weight": [1.0] * (replicas - 1) + [0.0],
                     "finite": [True] * replicas, "contributors": replicas - 1.0})  # fmt: skip
    return board


def _points(dom: str, chart: str) -> dict[str, int]:
    """``{series: number of points drawn}`` of the chart ``chart`` in the dumped page."""
    svg = re.search(rf'<svg id="chart-{chart}".*?</svg>', dom, re.S).group(0)
    lines = re.finditer(r'<polyline points="([^"]*)"[^>]*data-series="([^"]*)"', svg)
    return {m.group(2): len(m.group(1).split()) for m in lines}


def test_the_dashboard_draws_the_runs_points_and_rows(tmp_path):
    srv = serve.Server("127.0.0.1", 0, board=_board(), controls=serve.Controls(), token="t")
    srv.start()
    try:
        dom = headless(f"http://127.0.0.1:{srv.port}/", tmp_path, "--dump-dom")
    finally:
        srv.stop()
    assert "running: step 30 / 100" in dom
    assert "<b>mae</b>0.3" in dom and "<b>eval accuracy</b>0.6" in dom  # a loss's aux metric
    assert _points(dom, "loss") == {"train": 30, "eval": 3}
    assert _points(dom, "throughput") == {"tokens/s": 30}
    assert _points(dom, "metrics") == {"train mae": 30, "eval accuracy": 3}  # issue 39
    assert "eval time" not in dom and "eval tokens" not in dom  # issue 54
    # a log axis where the values span more than a decade: the loss (3 to 0.02), the metrics
    # (0.01 to 0.6), the drift (0.1 to 2.5); not the throughput nor the cosines
    scales = dict(re.findall(r'<svg id="chart-(\w+)"[^>]*data-scale="(\w+)"', dom))
    assert scales == {"loss": "log", "throughput": "linear", "metrics": "log", "drift": "log",
                      "cosine": "linear"}  # fmt: skip
    assert _points(dom, "drift") == {f"replica {r}": 5 for r in range(3)}
    assert _points(dom, "cosine") == {f"replica {r}": 5 for r in range(3)}
    rows = re.findall(r'<tr class="([^"]*)"><td>(\d+)</td>', dom)
    assert rows == [("contributed", "0"), ("contributed", "1"), ("left-out", "2")]


def test_the_dashboard_shows_a_sweeps_runs(tmp_path):
    srv = serve.Server("127.0.0.1", 0, board=_board(), controls=serve.Controls(), token="t")
    srv.sweep = serve.SweepBoard(["a", "b", "c"])
    srv.sweep.finished("a", {"run": "a", "final_eval_loss": 2.5, "bytes_per_replica": 1e6,
                             "sim_wallclock_s": 3.0, "utilization": 0.9})  # fmt: skip
    srv.sweep.started("b")
    srv.start()
    try:
        dom = headless(f"http://127.0.0.1:{srv.port}/", tmp_path, "--dump-dom")
    finally:
        srv.stop()
    rows = re.findall(r'<tr class="sweep-(\w+)"><td>(\w+)</td>', dom)
    assert rows == [("done", "a"), ("running", "b"), ("pending", "c")]
    assert "<td>2.5</td>" in dom
