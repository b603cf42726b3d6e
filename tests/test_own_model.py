"""Your own network in raysb's trainer: `--model package.module:factory`, with checkpoints,
resume and Ray Train workers as for the built-in models. The factory is defined here; its run on
2 Ray Train workers is tests/test_strategy_cards.py's (with an own strategy, both sent by value)."""

import json
import re
import subprocess
from pathlib import Path
import sys

import pytest
from torch import nn

import raysb.api
from raysb.api import train
from raysb.config import TrainConfig

from conftest import needs_fashion_mnist
from run_rows import untimed

pytestmark = needs_fashion_mnist


def two_layer_net(num_classes: int, in_channels: int, *, image_size: int, hidden: int = 32) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


def not_a_module(num_classes, in_channels):
    return "a network"


def raises(num_classes, in_channels):
    raise RuntimeError("weights file mynet.pt not found")


def seven_classes(num_classes, in_channels, image_size):
    return two_layer_net(7, in_channels, image_size=image_size)


def no_parameters(num_classes, in_channels):
    return nn.Sequential(nn.Flatten(), nn.AdaptiveAvgPool1d(num_classes))


def config(tmp_path, name="run", **overrides) -> TrainConfig:
    values = dict(
        dataset="fashion-mnist", subset=2000, test_subset=500, epochs=2, batch_size=50, lr=0.05,
        lr_warmup_epochs=0.25, model="test_own_model:two_layer_net", model_options={"hidden": 24},
        progress_seconds=0, out=str(tmp_path / name),
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


def test_own_model_trains_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    whole = train(config(tmp_path, "whole"), log=lambda _: None)
    assert whole.summary["status"] == "completed" and whole.final_test_error < 0.5
    hidden = whole.summary["config"]["model_options"]["hidden"]
    assert hidden == 24

    # The same 2-epoch run, stopped dead after its first checkpoint, then resumed.
    save = raysb.api.save_checkpoint_file

    def save_then_die(engine, out, epoch, rows, config):
        save(engine, out, epoch, rows, config)
        raise Killed

    monkeypatch.setattr(raysb.api, "save_checkpoint_file", save_then_die)
    with pytest.raises(Killed):
        train(config(tmp_path, "split"), log=lambda _: None)
    monkeypatch.setattr(raysb.api, "save_checkpoint_file", save)
    resumed = train(config(tmp_path, "split", resume=True), log=lambda _: None)
    assert untimed(resumed.metrics) == untimed(whole.metrics)


class Killed(Exception):
    pass


@pytest.mark.parametrize(
    "name, message",
    [
        ("test_own_model:missing", "test_own_model has no callable missing"),
        ("no_such_module_here:build", "cannot import no_such_module_here"),
        ("test_own_model:not_a_module", "returned str, not a torch.nn.Module"),
        ("test_own_model:", "name your own model as package.module:factory"),
        # Each of these once ended in a traceback: the factory's own, `IndexError: Target 9 is out of
        # bounds` at the first batch, `optimizer got an empty parameter list`.
        ("test_own_model:raises", "model 'test_own_model:raises': raises(num_classes, in_channels, **model_options) "
         "raised RuntimeError: weights file mynet.pt not found"),
        ("test_own_model:seven_classes", "model 'test_own_model:seven_classes' outputs (2, 7) for a batch of 2 "
         "images, but the data has 10 classes: it must output (batch, 10) logits"),
        ("test_own_model:no_parameters", "model 'test_own_model:no_parameters' has no trainable parameters"),
    ],
)
def test_a_bad_own_model_is_a_clear_error(tmp_path, capsys, name, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train(config(tmp_path, model=name, model_options={}, epochs=1), log=lambda _: None)
    from raysb.cli import main

    assert main(["train", "--model", name, "--subset", "1000", "--epochs", "1", "--out", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raysb: error: model") and err.count("\n") == 1


@pytest.mark.slow
def test_cli_finds_a_model_module_in_the_working_directory(tmp_path):
    (tmp_path / "mynets.py").write_text(
        "from torch import nn\n"
        "def linear(num_classes, in_channels, image_size):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, num_classes))\n"
    )
    done = subprocess.run(
        [str(Path(sys.executable).parent / "raysb"), "train", "--model", "mynets:linear", "--subset", "1000", "--test-subset",
         "200", "--epochs", "1", "--batch-size", "50", "--out", "run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["model"] == "mynets:linear" and summary["status"] == "completed"


def test_own_parquet_columns_in_the_trainer(tmp_path, capsys):
    """A user's Parquet file with its own column names, trained with its own model by `raysb train`."""
    from raysb.cli import main

    from test_data import write_users_splits

    data = tmp_path / "data"
    data.mkdir()
    write_users_splits(data, "uint8-list")  # columns pixels, target, row_id; 24 train, 8 test examples
    args = ["train", "--dataset", "parquet", "--data-dir", str(data), "--model", "test_own_model:two_layer_net",
            "--set", "parquet_columns.image=pixels", "--set", "parquet_columns.label=target",
            "--set", "parquet_columns.sample_id=row_id", "--epochs", "1", "--batch-size", "4",
            "--out", str(tmp_path / "run")]
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["train_examples"] == 24
    assert summary["config"]["parquet_columns"] == {"image": "pixels", "label": "target", "sample_id": "row_id"}
    # A name the file does not have is one line, exit 2.
    assert main([*args[:-2], "--set", "parquet_columns.label=y", "--out", str(tmp_path / "bad")]) == 2
    assert "no column 'y' (parquet_columns.label); found ['row_id', 'pixels', 'target', 'label']" in capsys.readouterr().err
