"""One error type (README, "Python API"): what `train()` and `TrainConfig` refuse before training is
a ConfigError (subclassing what they raised before, where code may catch that) with the one line
`raysb train` prints; a config value of the wrong type or kind, in a file or --set, is one line
naming its key; an unknown key gets "did you mean"."""

import numpy as np
import pytest

from raysb import ConfigError, TrainConfig, train
from raysb.cli import main


def cli_error(capsys, *args) -> str:
    """The one line `raysb train ARGS` prints as it refuses them, without its prefix."""
    assert main(["train", *args]) == 2
    error = capsys.readouterr().err
    assert error.startswith("raysb: error: ") and error.count("\n") == 1, error
    return error.removeprefix("raysb: error: ").rstrip("\n")


@pytest.fixture
def arrays(tmp_path):
    """A tiny NumPy data set: 3 classes of 6x6 grey images."""
    generator = np.random.default_rng(0)
    for split, count in (("train", 12), ("test", 6)):
        images = generator.integers(0, 256, (count, 6, 6), dtype=np.uint8)
        np.savez(tmp_path / f"{split}.npz", images=images, labels=np.arange(count) % 3)
    return str(tmp_path)


def test_train_refuses_before_training_with_the_line_the_cli_prints(tmp_path, capsys, arrays):
    quick = {"epochs": 1, "batch_size": 4, "progress_seconds": 0}
    cases = [
        # (config keys, what the refusal also is, for code that caught it before)
        ({"dataset": "parquet", "data_dir": str(tmp_path / "missing")}, FileNotFoundError),
        ({"dataset": "numpy", "data_dir": arrays, "model": "no_such_package.nets:mlp"}, None),
        ({"dataset": "numpy", "data_dir": arrays, "model": "resnet9"}, None),
        ({"dataset": "numpy", "data_dir": arrays, "model_options": {"width": "wide"}}, None),
        ({"dataset": "numpy", "data_dir": arrays, "model_options": {"depth": 3}}, None),
        ({"dataset": "numpy", "data_dir": arrays, "image_size": 2}, None),
    ]
    for number, (keys, also) in enumerate(cases):
        out = str(tmp_path / f"run{number}")
        with pytest.raises(ConfigError) as refused:
            train(TrainConfig(**keys, **quick, out=out), log=lambda _: None)
        assert also is None or isinstance(refused.value, also)
        flags = [f"--set={key}={value}" for key, value in {**keys, **quick}.items() if key != "model_options"]
        flags += [f"--set=model_options.{name}={value}" for name, value in keys.get("model_options", {}).items()]
        assert cli_error(capsys, *flags, "--out", out) == str(refused.value)


@pytest.mark.parametrize(("keys", "line"), [
    ({"epoch": 3}, "unknown key(s) in TrainConfig: epoch (did you mean epochs?)"),
    ({"cdf_lag": 2}, "TrainConfig: cdf_lag is gone: ranks now merge the shared CDF_R in every round's exchange"),
    ({"lr": "0.1"}, "lr must be a number, got '0.1'"),
    ({"subset": 2.5}, "subset must be a whole number (or left out), got 2.5"),
    ({"batch_size": True}, "batch_size must be a whole number (or left out), got True"),
    ({"eval_batch_size": True}, "eval_batch_size must be a whole number, got True"),
    ({"download": "yes"}, "download must be true or false, got 'yes'"),
    ({"model_options": ["depth", 16]}, "model_options must be a mapping (key: value, ...), got ['depth', 16]"),
    ({"lr_schedule": "step", "lr_milestones": ["a"]}, "lr_milestones must be a list of epochs (numbers), got ['a']"),
])
def test_a_key_train_config_does_not_have_or_a_value_of_the_wrong_type_is_a_config_error(keys, line):
    with pytest.raises(ConfigError) as refused:
        TrainConfig(**keys)
    assert str(refused.value).startswith(line)
    # Calling TrainConfig so raised TypeError before; code that catches it still does.
    assert isinstance(refused.value, TypeError) or "lr_milestones" in keys


def test_api_values_of_numpy_and_tuples_are_taken_as_their_python_kinds():
    config = TrainConfig(epochs=np.int64(3), lr=np.float32(0.5), lr_schedule="step", lr_milestones=(1, 2))
    assert (type(config.epochs), type(config.lr), config.lr_milestones) == (int, float, [1, 2])
    with pytest.raises(ConfigError, match=r"TrainConfig takes its keys by name"):
        TrainConfig("fashion-mnist")
    with pytest.raises(ConfigError, match=r"train\(\) takes a TrainConfig .*, got dict"):
        train({"epochs": 1})


@pytest.mark.parametrize(("key", "value", "kind"), [
    ("epochs", "true", "a whole number"),
    ("seed", "1.5", "a whole number"),
    ("horizontal_flip", "2", "true or false"),
    ("cutout", "yes", "a whole number"),
    ("lr", "[0.1]", "a number"),
    ("strategy", "[sb]", "a string"),
    ("model_options", "5", "a mapping (key: value, ...)"),
    ("parquet_columns", "[image]", "a mapping (key: value, ...)"),
])
def test_a_value_of_the_wrong_kind_in_a_file_or_set_is_one_line_naming_the_key(tmp_path, capsys, key, value, kind):
    config = tmp_path / "run.yaml"
    config.write_text(f"{key}: {value}\n")
    assert cli_error(capsys, "--config", str(config)).startswith(f"{key} in {config} must be {kind}")
    assert cli_error(capsys, "--set", f"{key}={value}").startswith(f"{key} in command line must be {kind}")


def test_set_typos_get_did_you_mean_and_are_named_as_given_beside_a_config_file(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("epochs: 2\nselectivty: 0.5\n")
    assert cli_error(capsys, "--set", "bach_size=32") == (
        "unknown key(s) in command line: bach_size (did you mean batch_size?)")
    assert cli_error(capsys, "--config", str(config), "--set", "lr_shedule=step") == (
        "unknown key(s) in command line: lr_shedule (did you mean lr_schedule?)")
    assert cli_error(capsys, "--config", str(config)) == (
        f"unknown key(s) in {config}: selectivty (did you mean selectivity?)")
    with pytest.raises(SystemExit):  # argparse's own refusal of a flag's value
        main(["train", "--lr-milestones", "30,sixty", "--lr-schedule", "step"])
    assert capsys.readouterr().err.endswith(
        "error: argument --lr-milestones: expected comma-separated numbers, got '30,sixty'\n")


def test_a_strategy_option_of_the_wrong_kind_is_one_line_naming_it(capsys):
    assert cli_error(capsys, "--strategy", "stale-sb", "--set", "strategy_options.staleness=abc") == (
        "strategy_options.staleness must be a whole number, got 'abc'")
    with pytest.raises(ConfigError, match=r"^strategy_options.staleness must be a whole number, got None$"):
        TrainConfig(strategy="stale-sb", strategy_options={"staleness": None})
    assert TrainConfig(strategy="stale-sb", strategy_options={"staleness": "2"}).staleness == 2
