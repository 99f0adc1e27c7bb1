"""Your own optax optimizers (issue 39): given to fit() or named by import path, through the
training loop, checkpoints and resume (the mesh: tests/test_user_task.py's 2x2 test runs a
clipped AdamW and an outer Adam); a changed optimizer refused on resume; bad ones in one line."""

import numpy as np
import optax
import pytest

import diloco_jax
from diloco_jax.algorithm import optim
from diloco_jax.config import ConfigError, recipe
from diloco_jax.fit import make_config
from tests.helpers import died_after
from tests.test_checkpoint import assert_bitwise_equal
from tests.test_user_task import TINY, linear_task

STEPS = {**TINY, "train.total_steps": 20, "train.eval_every": 10}
HERE = "tests.test_user_optimizers"


def clipped_adamw(lr: float, clip: float = 1.0) -> optax.GradientTransformation:
    """A user's inner optimizer, as the issue's user wrote it."""
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(lr))


def outer_adam(lr: float) -> optax.GradientTransformation:
    return optax.adam(lr, b1=0.8)


def not_a_transform(lr: float):
    return lr


def test_given_transforms_equal_to_the_configs_own_train_the_same_bits(tmp_path):
    """The config's AdamW and Nesterov SGD, built by hand and given to fit, train the built-in
    run's state bitwise: the given path changes nothing but where the optimizer comes from."""
    task, over = linear_task(), {**STEPS, "train.checkpoint": False}
    cfg = make_config("tiny", over)
    inner = recipe.inner_of(cfg)
    outer = optim.outer_optimizer("sgd", learning_rate=cfg.outer.learning_rate,
                                  momentum=cfg.outer.momentum)  # fmt: skip
    built_in = diloco_jax.fit(task, "tiny", workdir=tmp_path / "a", overrides=over,
                              show_progress=False)  # fmt: skip
    given = diloco_jax.fit(task, "tiny", workdir=tmp_path / "b", overrides=over, inner=inner,
                           outer=outer, show_progress=False)  # fmt: skip
    assert_bitwise_equal(given.summary["state"], built_in.summary["state"])
    recorded = (tmp_path / "b" / "config.json").read_text()
    assert '"optimizer": "given:' in recorded


def test_an_import_path_trains_what_the_given_transform_trains_and_both_resume(tmp_path):
    """``inner.optimizer=module:function`` with ``inner.args`` (the command line's way) trains
    the same bits as the transform given from Python; each resumes bitwise from step 10, and a
    resume with another optimizer is refused in one line, as a changed learning rate is."""
    task = linear_task()
    paths = {"inner.optimizer": f"{HERE}:clipped_adamw", "inner.args": '{"lr": 0.05}',
             "outer.optimizer": f"{HERE}:outer_adam", "outer.args": '{"lr": 0.3}'}  # fmt: skip
    imported = diloco_jax.fit(task, "tiny", workdir=tmp_path / "path",
                              overrides={**STEPS, **paths}, show_progress=False)  # fmt: skip
    mine = {"inner": clipped_adamw(0.05), "outer": outer_adam(0.3)}
    given = diloco_jax.fit(task, "tiny", workdir=tmp_path / "given", overrides=STEPS,
                           show_progress=False, **mine)  # fmt: skip
    assert_bitwise_equal(given.summary["state"], imported.summary["state"])
    assert imported.eval_loss < 0.5 * float(np.mean(task.train_data["y"] ** 2))  # it learned

    died_after(tmp_path / "given", 10, tmp_path / "given_cut")
    resumed = diloco_jax.fit(task, "tiny", workdir=tmp_path / "given_cut", overrides=STEPS,
                             show_progress=False, **mine)  # fmt: skip
    assert_bitwise_equal(resumed.summary["state"], given.summary["state"])
    died_after(tmp_path / "path", 10, tmp_path / "path_cut")
    resumed = diloco_jax.fit(task, "tiny", workdir=tmp_path / "path_cut",
                             overrides={**STEPS, **paths}, show_progress=False)  # fmt: skip
    assert_bitwise_equal(resumed.summary["state"], imported.summary["state"])

    with pytest.raises(ConfigError, match=r"config key inner.optimizer = 'given:\w+' differs"):
        diloco_jax.fit(task, "tiny", workdir=tmp_path / "given_cut", overrides=STEPS,
                       show_progress=False, inner=clipped_adamw(0.02),
                       outer=mine["outer"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"config key outer.args = .*differs"):
        diloco_jax.fit(task, "tiny", workdir=tmp_path / "path_cut", show_progress=False,
                       overrides={**STEPS, **paths, "outer.args": '{"lr": 0.5}'})  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,overrides,match",
    [
        ({}, {"inner.optimizer": "no_such_module:make"},
         r"inner.optimizer = 'no_such_module:make': cannot import no_such_module"),
        ({}, {"outer.optimizer": f"{HERE}:nothing_here"}, r"has no function 'nothing_here'"),
        ({}, {"inner.optimizer": f"{HERE}:not_a_transform", "inner.args": '{"lr": 1}'},
         r"returned is a int, not an optax GradientTransformation"),
        ({}, {"inner.optimizer": f"{HERE}:clipped_adamw", "inner.args": '{"rate": 1}'},
         r"inner.optimizer .* failed with inner.args .*unexpected keyword argument 'rate'"),
        ({}, {"inner.optimizer": "adamw!"}, r"inner.optimizer = 'adamw!' is invalid"),
        ({}, {"inner.args": "[1]"}, r"inner.args = '\[1\]' is invalid: must be a JSON object"),
        ({"inner": optax.adamw}, {}, r"the inner optimizer given is a function, not an optax"),
        ({"outer": optax.masked(optax.sgd(0.7), {"w": True, "b": False})}, {},
         r"the outer optimizer fails on the parameters: .*list of the parameters' leaves"),
        ({}, {"outer.optimizer": "given:0123456789ab"}, r"records a transform given from Python"),
    ],
    ids=["import", "name", "not-a-transform", "args", "spelling", "args-json", "uncalled",
         "masked-outer", "given-without-transform"],
)  # fmt: skip
def test_a_bad_optimizer_is_one_line_before_compiling(tmp_path, kwargs, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        diloco_jax.fit(linear_task(), "tiny", workdir=tmp_path, show_progress=False,
                       overrides={**STEPS, **overrides}, **kwargs)  # fmt: skip
    assert "\n" not in str(err.value)
    assert not (tmp_path / "config.json").exists()  # nothing written, nothing compiled
