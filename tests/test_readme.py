"""The code the README and the guides present as runnable runs as written and does what it
says: the library example (docs/guides/library.md), the README's task example (shown in
docs/guides/your_task.md, getting started and the landing page too, by inclusion) and the task
guide's grain example."""

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LIBRARY_GUIDE = ROOT / "docs" / "guides" / "library.md"
TASK_GUIDE = ROOT / "docs" / "guides" / "your_task.md"


def _run_block(page: pathlib.Path, marker: str, workdir: str = "", into=None) -> dict:
    """Runs the python block after ``<!-- marker -->`` in ``page`` as written, its ``workdir``
    string (double-quoted in the block) replaced by ``into``; returns the names it defined."""
    block = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```", page.read_text(), re.S)
    assert block, f"{page.name} lost its {marker}"
    code = block.group(1).replace(f'"{workdir}"', repr(str(into))) if workdir else block.group(1)
    scope: dict = {}
    exec(compile(code, str(page), "exec"), scope)  # noqa: S102
    return scope


def test_library_example_runs_and_the_anchor_reaches_the_mean_target(capsys):
    scope = _run_block(LIBRARY_GUIDE, "library-example")
    anchor = np.asarray(scope["state"].anchor)
    assert anchor.shape == (2,) and scope["state"].params.shape == (4, 2)
    np.testing.assert_allclose(anchor, [1.5, 0.375], atol=5e-3)
    assert "[1.5" in capsys.readouterr().out


def test_task_example_trains_a_users_task_to_the_true_weights(tmp_path, capsys):
    scope = _run_block(README, "task-example", "/tmp/runs/linear", tmp_path / "linear")
    np.testing.assert_allclose(scope["result"].params["w"], [1.0, -2.0, 0.5], atol=0.05)
    assert scope["result"].eval_loss < 1e-2
    assert (tmp_path / "linear" / "checkpoints").is_dir()


def test_the_task_guide_includes_the_readmes_example_rather_than_a_copy():
    guide = TASK_GUIDE.read_text()
    assert ":start-after: <!-- task-example -->" in guide and "ArrayTask({" not in guide
    assert "<!-- /task-example -->" in README.read_text()


def test_the_task_guides_grain_example_trains_to_the_true_weights(tmp_path):
    scope = _run_block(TASK_GUIDE, "grain-example", "/tmp/runs/grain", tmp_path / "grain")
    np.testing.assert_allclose(scope["result"].params["w"], [1.0, -2.0, 0.5], atol=0.05)
    assert scope["result"].eval_loss < 1e-2
    assert (tmp_path / "grain" / "checkpoints").is_dir()
