"""The code the README and the guides present as runnable runs as written and does what it
says: the library example (docs/guides/library.md) and the README's task example (shown in
docs/guides/your_task.md too, by inclusion)."""

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LIBRARY_GUIDE = ROOT / "docs" / "guides" / "library.md"


def test_library_example_runs_and_the_anchor_reaches_the_mean_target(capsys):
    text = LIBRARY_GUIDE.read_text()
    block = re.search(r"<!-- library-example -->\n```python\n(.*?)```", text, re.S)
    assert block, "the library guide lost its example"
    scope = {}
    exec(compile(block.group(1), str(LIBRARY_GUIDE), "exec"), scope)  # noqa: S102
    anchor = np.asarray(scope["state"].anchor)
    assert anchor.shape == (2,) and scope["state"].params.shape == (4, 2)
    np.testing.assert_allclose(anchor, [1.5, 0.375], atol=5e-3)
    assert "[1.5" in capsys.readouterr().out


def test_task_example_trains_a_users_task_to_the_true_weights(tmp_path, capsys):
    text = README.read_text()
    block = re.search(r"<!-- task-example -->\n```python\n(.*?)```", text, re.S)
    assert block, "the README lost its bring-your-own-task example"
    code = block.group(1).replace('"/tmp/runs/linear"', repr(str(tmp_path / "linear")))
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102
    np.testing.assert_allclose(scope["result"].params["w"], [1.0, -2.0, 0.5], atol=0.05)
    assert scope["result"].eval_loss < 1e-2
    assert (tmp_path / "linear" / "checkpoints").is_dir()


def test_the_task_guide_includes_the_readmes_example_rather_than_a_copy():
    guide = (ROOT / "docs" / "guides" / "your_task.md").read_text()
    assert ":start-after: <!-- task-example -->" in guide and "ArrayTask({" not in guide
    assert "<!-- /task-example -->" in README.read_text()


def test_the_task_guides_grain_example_trains_to_the_true_weights(tmp_path):
    guide = ROOT / "docs" / "guides" / "your_task.md"
    block = re.search(r"<!-- grain-example -->\n```python\n(.*?)```", guide.read_text(), re.S)
    assert block, "the task guide lost its grain example"
    code = block.group(1).replace('"/tmp/runs/grain"', repr(str(tmp_path / "grain")))
    scope = {}
    exec(compile(code, str(guide), "exec"), scope)  # noqa: S102
    np.testing.assert_allclose(scope["result"].params["w"], [1.0, -2.0, 0.5], atol=0.05)
    assert scope["result"].eval_loss < 1e-2
