"""The sweep's figures hold the data they claim (issue 61, item 9), read from the drawn lines
rather than the pixels: drift.png and cosine.png against inner steps, so runs of different
``sync_every`` share an axis; a drift spanning decades on a log axis with its zeros (a warm-up's
first sync) left out; an undefined cosine a gap, never 0; tradeoff.png's loss axis log where
the losses span a decade."""

import json
import math

import numpy as np
import pytest

from tests.test_drawing import drawn_figures

pytest.importorskip("matplotlib")


def _event(step: int, sync_every: int, drift: list, cosine: list) -> dict:
    return {"event": "sync", "step": step, "outer_step": step // sync_every, "drift": drift,
            "cosine_to_mean": cosine}  # fmt: skip


def _write(rundir, events) -> None:
    rundir.mkdir(parents=True)
    (rundir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _lines(fig) -> dict:
    """``{label: (x, y)}`` of the figure's drawn lines, as floats."""
    ax = fig.axes[0]
    return {line.get_label(): (np.asarray(line.get_xdata(), float),
                               np.asarray(line.get_ydata(), float))
            for line in ax.get_lines()}  # fmt: skip


def test_a_sweeps_drift_and_cosine_share_inner_steps_across_sync_periods(tmp_path, monkeypatch):
    """Two groups, sync_every 2 and 4, 16 inner steps: each line's x values are the inner steps
    of its syncs, so both have a point at 4, 8, 12 and 16, and there it is that sync's mean
    over replicas (a sweep draws each group's first seed)."""
    from sim import sweep

    figs = drawn_figures(monkeypatch)
    runs = []
    for sync_every in (2, 4):
        name = f"sync_every={sync_every},seed=0"
        events = [_event(s, sync_every, [s / 10, s / 5], [0.5, 0.7 + sync_every / 100])
                  for s in range(sync_every, 17, sync_every)]  # fmt: skip
        _write(tmp_path / "runs" / name, events)
        runs += [
            (name, f"sync_every={sync_every}", None),
            (f"sync_every={sync_every},seed=1", f"sync_every={sync_every}", None),
        ]
    assert sweep._diagnostics(tmp_path, runs) == ["drift.png", "cosine.png"]
    drift, cosine = (_lines(fig) for fig in figs)
    for fig in figs:
        assert fig.axes[0].get_xlabel() == "inner step"
    np.testing.assert_array_equal(drift["sync_every=2"][0], np.arange(2, 17, 2))
    np.testing.assert_array_equal(drift["sync_every=4"][0], [4, 8, 12, 16])
    for lines in (drift, cosine):
        shared = set(lines["sync_every=2"][0]) & set(lines["sync_every=4"][0])
        assert shared == {4.0, 8.0, 12.0, 16.0}
    for group, sync_every in (("sync_every=2", 2), ("sync_every=4", 4)):
        x, y = drift[group]
        np.testing.assert_allclose(y[x == 8], [(0.8 + 1.6) / 2])  # steps 8: drifts 0.8, 1.6
        x, y = cosine[group]
        np.testing.assert_allclose(y[x == 8], [(0.5 + 0.7 + sync_every / 100) / 2])


def _warm_up_run(drift_at: list, cosine: tuple = (0.8, 0.9)) -> list[dict]:
    """A run whose first sync comes before the learning rate has left 0: its drift is exactly 0
    and the step writes a cosine of 0 (undefined: no pseudo-gradient); the later drifts are
    ``drift_at`` (per replica, two replicas), the cosines ``cosine``."""
    first = _event(1, 1, [0.0, 0.0], [0.0, 0.0])
    return [first] + [_event(s, 1, d, list(cosine)) for s, d in enumerate(drift_at, start=2)]


@pytest.mark.parametrize("per_replica", [True, False])
def test_a_drift_spanning_a_decade_is_drawn_on_a_log_axis_without_its_zeros(
    tmp_path, monkeypatch, per_replica
):
    from diloco_jax.watch import drawing

    figs = drawn_figures(monkeypatch)
    spanning = _warm_up_run([[2.0, 1.8], [0.3, 0.25], [0.04, 0.05]], cosine=(0.9, 0.05))
    drawing.diagnostics({"a": spanning}, tmp_path, per_replica=per_replica)
    ax = figs[0].axes[0]
    assert ax.get_yscale() == "log" and "log scale" in ax.get_ylabel()
    assert figs[1].axes[0].get_yscale() == "linear"  # a cosine's, though its values span 18x
    for x, y in _lines(figs[0]).values():
        assert x[0] == 1 and math.isnan(y[0])  # the warm-up's 0: a gap, not a point at 0
        assert not (y == 0).any() and np.isfinite(y[1:]).all()
    within = _warm_up_run([[2.0, 1.8], [0.9, 0.8], [0.5, 0.4]])  # a decade it does not span
    drawing.diagnostics({"a": within}, tmp_path, per_replica=per_replica)
    assert figs[2].axes[0].get_yscale() == "linear"
    for _, y in _lines(figs[2]).values():
        assert y[0] == 0  # a linear axis shows the 0 it was given


@pytest.mark.parametrize("per_replica", [True, False])
def test_an_undefined_cosine_is_a_gap_never_0(tmp_path, monkeypatch, per_replica):
    """The warm-up's first sync (no pseudo-gradient: drift 0, a cosine written as 0) and a NaN
    cosine (a left-out replica) are gaps in the drawn lines; a defined cosine of 0 stays 0."""
    from diloco_jax.watch import drawing

    figs = drawn_figures(monkeypatch)
    events = _warm_up_run([[1.0, 1.1], [0.9, 0.8]])
    events.append(_event(4, 1, [0.7, 0.6], [float("nan"), float("nan")]))
    events.append(_event(5, 1, [0.5, 0.6], [0.0, 0.0]))  # orthogonal to the mean: defined
    _write(tmp_path / "run", events)
    read = drawing.sync_events(tmp_path / "run" / "metrics.jsonl")  # NaN through the JSON
    drawing.diagnostics({"a": read}, tmp_path, per_replica=per_replica)
    lines = _lines(figs[1])
    assert figs[1].axes[0].get_yscale() == "linear"
    for x, y in lines.values():
        np.testing.assert_array_equal(x, [1, 2, 3, 4, 5])
        assert math.isnan(y[0]) and math.isnan(y[3]) and y[4] == 0
        np.testing.assert_allclose(y[1:3], [np.mean(y[1:3])] * 2)  # 0.8 / 0.9 / their mean
        assert 0.79 < y[1] < 0.91


def _rows(losses: list[float]) -> list[dict]:
    bytes_sent = [0.0, 1e9, 2e8, 1e8, 5e7]
    names = ["single", "ddp", "sync_every=5", "sync_every=10", "sync_every=20"]
    return [{"run": n, "final_eval_loss": v, "final_eval_loss_std": 0.0, "seeds": 1,
             "bytes_per_replica": b, "peak_sync_bytes": b}
            for n, v, b in zip(names, losses, bytes_sent, strict=True)]  # fmt: skip


def test_tradeoffs_loss_axis_is_log_where_the_losses_span_a_decade(tmp_path, monkeypatch):
    from sim import plots

    figs = drawn_figures(monkeypatch)
    spanning, within = _rows([0.9, 0.05, 0.06, 0.08, 0.2]), _rows([3.1, 2.2, 2.3, 2.5, 2.9])
    plots.tradeoff(spanning, tmp_path / "log.png", nats=False, label="validation MSE")
    plots.tradeoff(within, tmp_path / "linear.png")
    plots.tradeoff_two_panels(spanning, tmp_path / "two.png")
    (log,), (linear,), (top, _) = (fig.axes for fig in figs)
    assert log.get_yscale() == "log" and log.get_ylabel() == "final validation MSE (log scale)"
    assert linear.get_yscale() == "linear"
    assert linear.get_ylabel() == "final validation loss (nats/token)"
    assert top.get_yscale() == "log" and top.get_ylabel().endswith("(log scale)")
    drawn = [y for line in log.get_lines() for y in np.atleast_1d(line.get_ydata())]
    assert 0.05 in drawn and 0.9 in drawn  # the points and the no-communication line
