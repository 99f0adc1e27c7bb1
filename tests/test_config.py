"""Presets, overrides and validation: every bad value stops with one clear line."""

import subprocess
import sys

import pytest

from diloco_jax import config as config_lib
from diloco_jax.config import Config, ConfigError, apply_overrides, load_preset, presets, validate


def test_presets_load_and_validate():
    for name in ("default", "tiny"):
        cfg = load_preset(f"configs/{name}.py")
        validate(cfg)
    assert load_preset(config_lib.DEFAULT_PRESET) == Config()


def test_overrides_parse_by_field_type():
    cfg = apply_overrides(Config(), [("outer.sync_every", "7"), ("inner.learning_rate", "1e-4"),
                                     ("outer.nesterov", "false"), ("data.corpus", "x.txt"),
                                     ("algorithm", "ddp")])  # fmt: skip
    assert cfg.outer.sync_every == 7 and cfg.inner.learning_rate == 1e-4
    assert cfg.outer.nesterov is False and cfg.data.corpus == "x.txt" and cfg.algorithm == "ddp"
    assert cfg.model == Config().model  # untouched sections stay


@pytest.mark.parametrize(
    "key,value,match",
    [
        (
            "outer.sync_evry",
            "5",
            "unknown config key 'outer.sync_evry'; did you mean outer.sync_every",
        ),
        ("outer.sync_every", "five", "outer.sync_every: 'five' is not a valid int"),
        ("outer.nesterov", "maybe", "not a bool"),
    ],
)
def test_bad_overrides(key, value, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(Config(), [(key, value)])


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("outer.sync_every", "0", r"outer.sync_every = 0 is invalid: must be an integer >= 1"),
        ("parallel.replica_devices", "3", "must divide parallel.replicas = 4"),
        ("parallel.data_devices", "3", "data.batch_size = 16 .*divisible by parallel.data_devices"),
        ("algorithm", "fedavg", "one of"),
        ("model.num_heads", "3", "model.d_model = 128 .*divisible by model.num_heads = 3"),
        ("outer.momentum", "1.5", r"outer.momentum = 1.5 .*\[0, 1\)"),
        ("train.checkpoint_every", "30", "multiple of train.log_every = 25"),
        ("train.checkpoint_every", "75", "multiple of outer.sync_every = 50 .*sync boundaries"),
        # the optimizers' own checks (algorithm/optim.py), written with config keys
        ("inner.learning_rate", "inf", "inner.learning_rate = inf .*finite number > 0"),
        ("inner.learning_rate", "-1e-3", "inner.learning_rate = -0.001 .*finite number > 0"),
        ("inner.weight_decay", "-1", "inner.weight_decay = -1.0 .*finite number >= 0"),
        ("inner.b1", "2", r"inner.b1 = 2.0 .*\[0, 1\)"),
        ("inner.b2", "-0.5", r"inner.b2 = -0.5 .*\[0, 1\)"),
        ("inner.clip_norm", "nan", "inner.clip_norm = nan .*finite"),
        ("outer.learning_rate", "nan", "outer.learning_rate = nan .*finite number > 0"),
    ],
)
def test_validate_names_key_value_and_rule(key, value, match):
    with pytest.raises(ConfigError, match=match):
        validate(apply_overrides(Config(), [(key, value)]))


def _train_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "diloco_jax.train", "--config", "configs/tiny.py", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "args,message,child",
    [
        (["--config.outer.sync_every=0"], "error: config key outer.sync_every = 0 is invalid",
         False),
        (["--config.bogus=1"], "error: unknown config key 'bogus'", False),
        (["--config.data.corpus=/no/such.txt"], "error: data file not found: /no/such.txt", True),
        (["--config.parallel.replica_devices=3"], "must divide parallel.replicas = 4", False),
        (["--config.data.batch_size=5", "--config.parallel.data_devices=2"],
         "data.batch_size = 5 is invalid", False),
        (["--config", "configs/nope.py"], "error: config preset not found: configs/nope.py",
         False),
        (["--frobnicate=1"], "error: unknown flag --frobnicate", True),
        (["--config.outer.sync_evry=5"],
         "error: unknown config key 'outer.sync_evry'; did you mean outer.sync_every?", False),
        (["--config.outer.sync_every=x"], "--config.outer.sync_every: 'x' is not int", False),
    ],
)  # fmt: skip
def test_cli_bad_input_is_one_line_and_exit_2(args, message, child, tmp_path, capsys):
    """In a child process where what is checked comes after JAX starts (the data is read in
    the run) and for one flag error, the process's exit status and its whole stderr; the other
    errors come from parsing the command line, before anything starts: ``main`` in this
    process, its exit status and what it printed."""
    argv = ["--workdir", str(tmp_path / "w"), *args]
    if child:
        result = _train_cli(*argv)
        code, stderr = result.returncode, result.stderr
    else:
        from diloco_jax.train import main

        with pytest.raises(SystemExit) as exited:
            main(["--config", "configs/tiny.py", *argv])
        code, stderr = exited.value.code, capsys.readouterr().err
    assert code == 2, stderr
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_cli_help_describes_every_key_with_the_presets_value():
    result = _train_cli("--help")
    assert result.returncode == 0
    text = "".join(result.stdout.split())  # argparse wraps lines where it likes
    tiny = load_preset("tiny")
    for key, leaf in config_lib.described(tiny).items():
        assert f"--config.{key}" in result.stdout
        assert "".join(f"{leaf.about} (preset: {leaf.value!r})".split()) in text, key
    assert "--config.KEY=VALUE" in result.stdout and "--allow_config_change" in result.stdout
    assert "".join(", ".join(presets.names()).split()) in text


def test_every_key_has_a_one_line_description():
    described = config_lib.described(Config())
    assert len(described) == len(config_lib.keys(Config())) > 70
    for key, leaf in described.items():
        assert leaf.about.strip() and "\n" not in leaf.about and len(leaf.about) <= 100, key
        assert isinstance(leaf.value, leaf.kind), key


def test_overrides_on_the_command_line_equal_apply_overrides(tmp_path):
    from diloco_jax.config import cli

    pairs = [("outer.sync_every", "7"), ("sim.speeds", "1,1,0.5,0.5"), ("outer.nesterov", "no"),
             ("inner.learning_rate", "1e-4"), ("train.sample_prompt", "")]  # fmt: skip
    argv = ["--config", "tiny", "--workdir", str(tmp_path)]
    argv += [f"--config.{k}={v}" for k, v in pairs[:3]] + [f"--config.{pairs[3][0]}", pairs[3][1]]
    argv += ["--config.train.sample_prompt="]
    args = cli.parse(argv, prog="t")
    assert args.cfg == apply_overrides(load_preset("tiny"), pairs)


def test_a_diloco_run_that_never_syncs_is_named_in_one_line():
    """``outer.sync_every`` past ``train.total_steps``: one notice naming both keys (issue 54:
    the task guide's sweep trained without a word); none for the presets as they are, or for a
    baseline that has no syncs."""
    from diloco_jax.config import validation

    tiny = load_preset("tiny")
    assert validation.notices(tiny) == [] and validation.notices(load_preset("default")) == []
    never = config_lib.apply_overrides(tiny, [("outer.sync_every", "50")])
    (line,) = validation.notices(never)
    assert line.startswith(f"outer.sync_every = 50 > train.total_steps = "
                           f"{tiny.train.total_steps}: this run never syncs")  # fmt: skip
    ddp = config_lib.apply_overrides(never, [("algorithm", "ddp")])
    assert validation.notices(ddp) == []
