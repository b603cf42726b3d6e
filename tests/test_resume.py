"""A single-process run is never lost: an --out holding a run is refused unless --resume or
--overwrite says otherwise, and a run killed mid-epoch resumes exactly from its checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from raysb.api import train
from raysb.cli import main
from raysb.config import ConfigError, TrainConfig
from raysb.training.checkpoint import CHECKPOINT_FILE

from conftest import needs_fashion_mnist
from run_rows import untimed

pytestmark = needs_fashion_mnist

SMALL = ["--dataset", "fashion-mnist", "--subset", "4000", "--test-subset", "500", "--seed", "1",
         "--strategy", "stale-sb", "--staleness", "2"]


def raysb_train(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "raysb", "train", *SMALL, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rows_of(out: Path) -> list[dict]:
    return untimed(pq.read_table(out / "metrics.parquet").to_pylist())


def checkpointed_epoch(out: Path) -> int:
    path = out / CHECKPOINT_FILE
    return torch.load(path, weights_only=False)["epoch"] if path.exists() else 0


def test_a_run_killed_mid_epoch_resumes_exactly_as_if_never_stopped(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    reference = raysb_train("--epochs", "5", "--out", str(whole))
    assert reference.wait(timeout=600) == 0, reference.stdout.read()

    run = raysb_train("--epochs", "5", "--out", str(killed))
    deadline = time.monotonic() + 600
    while checkpointed_epoch(killed) < 2 and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGKILL)  # in epoch 3: nothing gets to clean up
    run.wait(timeout=60)
    assert not (killed / "summary.json").exists(), "the run finished before it was killed"
    assert checkpointed_epoch(killed) == 2 and len(rows_of(killed)) >= 2

    resumed = raysb_train("--epochs", "5", "--resume", "--out", str(killed))
    output = resumed.stdout.read()
    assert resumed.wait(timeout=600) == 0, output
    assert "resumed from the checkpoint after epoch 2" in output
    assert rows_of(killed) == rows_of(whole)
    counts = ("examples_kept", "backprop_examples", "selection_forward_examples", "optimizer_steps")
    summary = lambda out: json.loads((out / "summary.json").read_text())  # noqa: E731
    assert {k: summary(killed)[k] for k in counts} == {k: summary(whole)[k] for k in counts}


def config(out: Path, **overrides) -> TrainConfig:
    values = dict(dataset="fashion-mnist", subset=1000, test_subset=200, epochs=1, model_options={"width": 8},
                  out=str(out))
    return TrainConfig(**{**values, **overrides})


def test_an_out_holding_a_run_is_refused_and_left_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    train(config(out), log=lambda line: None)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert main(["train", "--dataset", "fashion-mnist", "--subset", "1000", "--epochs", "1", "--out", str(out)]) == 2
    assert f"--out {out} already holds a run; pass --resume to continue it, --overwrite to replace it" in (
        capsys.readouterr().err
    )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_overwrite_replaces_the_run_and_only_its_files(tmp_path):
    out = tmp_path / "run"
    train(config(out, seed=0), log=lambda line: None)
    (out / "notes.txt").write_text("mine")
    train(config(out, seed=1, overwrite=True), log=lambda line: None)
    assert (out / "notes.txt").read_text() == "mine"
    assert TrainConfig.load(out / "config.yaml").seed == 1
    # The saved config never says overwrite: running it again cannot replace this run.
    assert TrainConfig.load(out / "config.yaml").overwrite is False
    with pytest.raises(ConfigError, match="give one of them"):
        config(out, resume=True, overwrite=True)


def test_resume_needs_a_checkpoint_and_epochs_left(tmp_path):
    with pytest.raises(ConfigError, match=f"--resume: --out {tmp_path / 'none'} holds no checkpoint"):
        train(config(tmp_path / "none", resume=True), log=lambda line: None)
    out = tmp_path / "done"
    train(config(out), log=lambda line: None)
    with pytest.raises(ConfigError, match="has finished 1 of 1 epochs; give more --epochs"):
        train(config(out, resume=True), log=lambda line: None)
    resumed = train(config(out, resume=True, epochs=2), log=lambda line: None)
    assert [row["epoch"] for row in resumed.metrics] == [1, 2]
