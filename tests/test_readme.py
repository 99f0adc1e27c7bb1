"""The README's library example runs as written and does what it says."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_library_example_runs_and_the_anchor_reaches_the_mean_target(capsys):
    text = README.read_text()
    block = re.search(r"<!-- library-example -->\n```python\n(.*?)```", text, re.S)
    assert block, "the README lost its library example"
    scope = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)  # noqa: S102
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
