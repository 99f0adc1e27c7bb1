"""A run's figures drawn by a helper process (issue 28): it imports matplotlib while the run
compiles, and draws when the run ends, on another core than the run's last saves. The same
figures as drawn in the run's own process; a failure is a warning; a helper that is gone is
replaced by drawing in the run's process; it never imports JAX; it ends with its input."""

import json
import logging
import subprocess
import sys
import threading

import pytest

from diloco_jax.watch import drawing, figures

pytest.importorskip("matplotlib")


def _synced_run(directory, replicas=3):
    directory.mkdir(parents=True, exist_ok=True)
    events = [{"event": "sync", "step": 10 * k, "outer_step": k,
               "drift": [0.1 * k + r for r in range(replicas)],
               "cosine_to_mean": [0.9 - 0.01 * r for r in range(replicas)]}
              for k in range(1, 6)]  # fmt: skip
    (directory / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return directory


def test_the_helper_draws_the_files_this_process_draws(tmp_path):
    helper = figures.start_helper()
    assert helper is not None and helper.alive()
    assert figures.start_helper() is helper  # one per process, shared by its runs
    there, here = _synced_run(tmp_path / "helper"), _synced_run(tmp_path / "here")
    assert helper.draw(there) == ["drift.png", "cosine.png"]
    assert figures.run_diagnostics(here) == ["drift.png", "cosine.png"]
    for name in ("drift.png", "cosine.png"):
        assert (there / name).read_bytes() == (here / name).read_bytes()


def test_a_figure_the_helper_cannot_draw_is_a_warning(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"event": "sync", "outer_step": 1}\n')  # no drift
    with caplog.at_level(logging.WARNING, logger="diloco_jax"):
        assert figures.start_helper().draw(tmp_path) == []
    assert "drift.png and cosine.png not drawn: KeyError" in caplog.text
    assert figures.start_helper().alive()  # and it goes on answering


def test_a_helper_that_is_gone_is_replaced_by_drawing_here(tmp_path):
    helper = figures.start_helper()
    helper.process.kill()
    helper.process.wait(timeout=30)
    assert helper.draw(_synced_run(tmp_path / "a")) is None  # gone: no answer
    figures.draw_in_background(tmp_path / "a").join()  # a new helper draws it
    assert (tmp_path / "a" / "drift.png").exists()
    assert figures.start_helper() is not helper and figures.start_helper().alive()
    run = _synced_run(tmp_path / "b")
    figures.start_helper().process.kill()
    figures.start_helper().process.wait(timeout=30)
    # started before the kill was seen: the request finds it gone and draws in this process
    figures._helper = helper
    figures.draw_in_background(run).join()
    assert (run / "drift.png").exists() and (run / "cosine.png").exists()


def test_the_helper_ends_when_its_input_closes():
    helper = figures._Helper()
    helper.stop()
    assert helper.process.wait(timeout=60) == 0


def test_the_helper_never_imports_jax():
    """It runs drawing.py as a script, with numpy and matplotlib alone: starting JAX there
    would take the core and the memory that the run's compile needs."""
    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); "
            "import matplotlib.figure; print(sorted(m for m in ('jax', 'diloco_jax', 'flax') "
            "if m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-P", "-c", code, drawing.__file__],
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]"


def test_a_helper_that_answers_out_of_protocol_is_stopped_and_replaced(tmp_path):
    """A reply that is not the protocol's (something else printed it) ends that helper; the
    figures are drawn in this process and the next run starts a new helper."""
    liar = figures._Helper.__new__(figures._Helper)
    liar.lock = threading.Lock()
    liar.process = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.stdin.readline(); print('hello'); "
         "sys.stdout.flush(); time.sleep(120)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    run = _synced_run(tmp_path)
    assert liar.draw(run) is None
    assert liar.process.wait(timeout=30) != 0  # killed
    figures._helper = liar
    figures.draw_in_background(run).join()
    assert (run / "drift.png").exists() and figures.start_helper() is not liar


# The docs column: sphinx_book_theme shows an image at most the content width, ~750 CSS px
# (96 px an inch); a figure drawn WIDTH inches wide is shown at 750 / (96 * WIDTH) of its size.
PAGE_PX = 750


def drawn_figures(monkeypatch) -> list:
    """The figures saved from now on (``Figure.savefig`` patched to keep them, laid out)."""
    from matplotlib.figure import Figure

    kept, real = [], Figure.savefig

    def savefig(fig, *args, **kwargs):
        fig.canvas.draw()
        kept.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return kept


def smallest_shown_pt(fig) -> float:
    """The smallest of the figure's texts (ticks, labels, legends, titles, annotations) in
    points as the docs page shows it, the figure scaled to :data:`PAGE_PX`."""
    from matplotlib.text import Text

    shown = min(PAGE_PX / (96 * fig.get_figwidth()), 1.0)  # a narrow figure is not enlarged
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    return min(sizes) * shown


def test_a_log_axis_for_values_that_span_decades_only():
    assert drawing.log_scale([2.3, 0.74, 0.003])  # a loss from step 0 to the end of training
    assert drawing.log_scale([None, float("nan"), 1.0, 10.5])
    assert not drawing.log_scale([3.0, 1.9, 1.5])  # within a decade
    assert not drawing.log_scale([0.0, 0.1, 5.0])  # a zero (a left-out replica's drift)
    assert not drawing.log_scale([-0.2, 0.5, 0.9])  # cosines
    assert not drawing.log_scale([])


def test_a_runs_figures_read_at_9_pt_with_a_log_axis_for_a_drift_spanning_decades(
    tmp_path, monkeypatch
):
    figs = drawn_figures(monkeypatch)
    events = [{"event": "sync", "step": 10 * k, "outer_step": k,
               "drift": [10.0 ** -k, 2 * 10.0 ** -k], "cosine_to_mean": [0.9, -0.1]}
              for k in range(1, 5)]  # fmt: skip
    assert drawing.diagnostics({"run": events}, tmp_path, per_replica=True) == [
        "drift.png", "cosine.png"]  # fmt: skip
    drift, cosine = (fig.axes[0] for fig in figs)
    assert (drift.get_yscale(), cosine.get_yscale()) == ("log", "linear")
    assert drift.get_ylabel().endswith("(log scale)")
    assert all(smallest_shown_pt(fig) >= 9 for fig in figs)
