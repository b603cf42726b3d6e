"""A single-process run is never lost: an --out holding a run is refused unless --resume or
--overwrite says otherwise, a run killed mid-epoch resumes exactly from its checkpoint, a resume
takes the run's own config and changes only what it can, and Ctrl-C or SIGTERM ends a run with
one line saying how to continue it."""

import json
import os
import shlex
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
from raysb.resume import schedule_note
from raysb.training.checkpoint import CHECKPOINT_FILE
from raysb.training.interrupt import Interrupted, interrupts_deferred, signals_interrupt
from raysb.training.outputs import claim_out

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


@pytest.mark.slow
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


def test_resume_continues_from_the_runs_own_config(tmp_path, capsys):
    """The user's run had --subset and --strategy traditional; `--out DIR --resume` alone once
    tracebacked (a 60000-example trace against the 1000 checkpointed)."""
    out = tmp_path / "run"
    made = ["train", "--dataset", "fashion-mnist", "--subset", "1000", "--test-subset", "200", "--strategy",
            "traditional", "--epochs", "1", "--set", "model_options.width=8", "--out", str(out)]
    assert main(made) == 0
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2"]) == 0
    printed = capsys.readouterr().out
    assert ("raysb: resuming with epochs=2 (made with 1): the cosine lr schedule, keyed to epochs, "
            "now decays to 0 at epoch 2 instead of at epoch 1") in printed
    assert "resumed from the checkpoint after epoch 1" in printed
    assert "traditional on fashion-mnist (1000 train" in printed
    assert [row["epoch"] for row in rows_of(out)] == [1, 2]
    # The closing line names the checkpoint the resume wrote, to resume from again.
    assert printed.splitlines()[-1].endswith(f"{out}: metrics.parquet, summary.json, best_model.pt, checkpoint.pt")
    # README's way round it before: the run's own config file, given back with --resume.
    assert main(["train", "--config", str(out / "config.yaml"), "--resume", "--epochs", "3"]) == 0
    assert [row["epoch"] for row in rows_of(out)] == [1, 2, 3]


@pytest.mark.parametrize("flags, refused", [
    (["--strategy", "sb"], "strategy=traditional, not strategy=sb; a resume continues a run as it was made: leave it"),
    (["--subset", "500", "--set", "model_options.width=16"],
     "model_options={'width': 8}, subset=1000, not model_options={'width': 16}, subset=500; a resume continues a run "
     "as it was made: leave them"),
    (["--workers", "2"], "workers=None, not workers=2; a resume continues a run as it was made: leave it"),
])
def test_resume_names_each_setting_it_cannot_change_in_one_line(tmp_path, capsys, flags, refused):
    """Resuming a traditional run with --strategy sb once ended in KeyError: 'selector'."""
    out = tmp_path / "run"
    train(config(out, strategy="traditional"), log=lambda line: None)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2", *flags]) == 2
    assert capsys.readouterr().err == (
        f"raysb: error: --resume: the run in {out} was made with {refused} out to resume, or give another --out for "
        "a new run\n"
    )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_the_api_refuses_a_resume_whose_config_differs_before_loading_data(tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(config(out), log=lambda line: None)
    monkeypatch.setattr("raysb.api.prepare_data", lambda config: pytest.fail("the data was loaded"))
    # The user's RuntimeError: resumed without the run's subset.
    with pytest.raises(ConfigError, match=r"made with subset=1000, not subset=None; "):
        train(config(out, subset=None, epochs=2, resume=True), log=lambda line: None)


@pytest.mark.parametrize("made, resumed, note", [
    (dict(time_budget=60.0), dict(time_budget=120.0),
     "time_budget=120 (made with 60): the cosine lr schedule, keyed to the time budget, now decays to 0 at 120s of "
     "training instead of at 60s of training"),
    (dict(lr_schedule="step", lr_milestones=[2, 4], epochs=6), dict(epochs=8),
     "epochs=8 (made with 6): the step lr schedule, keyed to epochs, is unchanged: it decays by 0.2 at epochs 2, 4"),
    (dict(epochs=10), dict(time_budget=30.0),
     "time_budget=30 (made with None): the cosine lr schedule, keyed to epochs, is unchanged: it decays to 0 at "
     "epoch 10; a budget that stops the run sooner stops it before the lr has decayed"),
    (dict(lr_schedule="linear", lr_schedule_key="backprop", epochs=4), dict(epochs=6),
     "epochs=6 (made with 4): the linear lr schedule, keyed to backpropagated examples, now decays to 0 at 6 "
     "epochs' worth of backpropagated examples instead of at 4 epochs' worth of backpropagated examples"),
    # Epochs given beside a budget end the run where they come first, and the schedule with them.
    (dict(work_budget=5.0), dict(epochs=4),
     "epochs=4 (made with None): the cosine lr schedule, keyed to the work budget, now decays to 0 at 5 epochs of "
     "work or at epoch 4, whichever comes first instead of at 5 epochs of work"),
])
def test_a_new_epochs_or_time_budget_says_what_it_does_to_the_schedule(made, resumed, note):
    saved = TrainConfig(**made).settings().optimization
    resumed = TrainConfig(**{**made, **resumed, "lr_schedule_key": saved.lr_schedule_key}).settings().optimization
    assert schedule_note(saved, resumed) == f"raysb: resuming with {note}"
    assert schedule_note(saved, saved) is None


def test_a_run_stopped_before_its_first_checkpoint_does_not_lock_its_out(tmp_path, capsys):
    """Interrupted (or failed on a NaN) before its first checkpoint, a run leaves config.yaml and
    perhaps some metrics: a new run in that --out once was "already holds a run" and --resume
    "holds no checkpoint"."""
    out = tmp_path / "run"
    train(config(out), log=lambda line: None)
    for name in (CHECKPOINT_FILE, "summary.json"):
        (out / name).unlink()  # as if stopped while writing its first checkpoint
    assert main(["train", "--out", str(out), "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"raysb: error: --resume: --out {out} holds no checkpoint to continue from; its run stopped before its first "
        "checkpoint: run it again without --resume\n"
    )
    again = train(config(out, epochs=1), log=print)
    assert f"raysb: --out {out} held a run that stopped before its first checkpoint; starting it again" in (
        capsys.readouterr().out
    )
    assert [row["epoch"] for row in again.metrics] == [1] and rows_of(out) == untimed(again.metrics)
    # A run that failed before its first checkpoint leaves a summary that says so: no lock either.
    (out / CHECKPOINT_FILE).unlink()
    (out / "summary.json").write_text(json.dumps({"status": "failed", "error": "a NaN at epoch 1, step 3"}))
    assert claim_out(out, resume=False, overwrite=False) is not None and not (out / "summary.json").exists()


def interrupted(out: Path, signal_number: int, *args: str) -> tuple[int, str]:
    """`raysb train` in its own process group, sent the signal after its first checkpoint: by
    Ctrl-C, as a terminal does, to the whole group; SIGTERM to the process, as `kill` does."""
    run = subprocess.Popen([sys.executable, "-m", "raysb", "train", *SMALL, "--out", str(out), *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while checkpointed_epoch(out) < 1 and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if signal_number == signal.SIGINT:
        os.killpg(run.pid, signal_number)
    else:
        run.send_signal(signal_number)
    output, _ = run.communicate(timeout=120)
    return run.returncode, output


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_a_checkpoints_commit_is_raised_once_the_commit_is_recorded(signal_number):
    """The run below once ended with "before its first checkpoint: nothing to resume" while its
    checkpoint was on disk: the signal came after the file's commit and before the run recorded it."""
    recorded = []
    with signals_interrupt():
        with pytest.raises(Interrupted) as stopped:
            with interrupts_deferred():
                os.kill(os.getpid(), signal_number)
                time.sleep(0.05)  # the handler has run by now (at the next bytecode)
                recorded.append("checkpoint")
        assert recorded == ["checkpoint"] and stopped.value.signal_name == signal.Signals(signal_number).name


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_an_interrupted_run_ends_with_one_line_saying_how_to_continue(tmp_path, signal_number):
    out = tmp_path / "run"
    status, output = interrupted(out, signal_number, "--epochs", "4")
    assert not (out / "summary.json").exists(), "the run finished before it was interrupted"
    assert status == 128 + signal_number, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    checkpoint = checkpointed_epoch(out)
    assert output.splitlines()[-1] == (
        f"raysb: stopped by {signal.Signals(signal_number).name} in epoch {checkpoint + 1} of 4; last checkpoint "
        f"after epoch {checkpoint} ({out / CHECKPOINT_FILE}); continue with: raysb train --out {out} --resume"
    )
    if signal_number == signal.SIGINT:  # the command it names continues the run (the same for SIGTERM)
        command = shlex.split(output.splitlines()[-1].split("continue with: ")[1])
        resumed = subprocess.run([sys.executable, "-m", "raysb", *command[1:]], capture_output=True, text=True,
                                 timeout=600)
        assert resumed.returncode == 0, resumed.stderr
        assert [row["epoch"] for row in rows_of(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_an_interrupt_before_the_first_checkpoint_leaves_the_out_free(tmp_path):
    out = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-m", "raysb", "train", *SMALL, "--subset", "20000", "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not (out / "config.yaml").exists() and run.poll() is None:
        time.sleep(0.02)
    run.send_signal(signal.SIGINT)
    output, _ = run.communicate(timeout=120)
    assert run.returncode == 130 and not (out / CHECKPOINT_FILE).exists(), output
    assert output.splitlines()[-1] == (
        "raysb: stopped by SIGINT in epoch 1 of 10, before its first checkpoint: nothing to resume; the same command "
        "starts the run again"
    )
    assert main(["train", *SMALL, "--epochs", "1", "--out", str(out)]) == 0


def test_an_interrupt_whose_exception_was_swallowed_still_stops_the_run_at_its_next_round():
    """A signal's handler runs wherever the main thread is; there (an import hook, a finalizer) Python
    may print its exception as "ignored" and go on. The loop asks again at every round."""
    from raysb.training.interrupt import Interrupted, raise_if_received, signals_interrupt

    with signals_interrupt():
        try:
            signal.raise_signal(signal.SIGINT)
        except Interrupted:
            pass  # swallowed, as an "Exception ignored in ..." would be
        with pytest.raises(Interrupted, match="SIGINT"):
            raise_if_received()
    raise_if_received()  # the block is over: nothing pending


@pytest.mark.parametrize("damage", [lambda data: data[:1000], lambda data: b"garbage\n"])
def test_a_damaged_checkpoint_is_one_line_and_left_in_place(tmp_path, capsys, damage):
    """A truncated or overwritten checkpoint.pt once ended --resume in torch's traceback
    (`PytorchStreamReader failed reading zip archive`, `mmap can only be used with files saved with`)."""
    out = tmp_path / "run"
    train(config(out), log=lambda line: None)
    (out / CHECKPOINT_FILE).write_bytes(damage((out / CHECKPOINT_FILE).read_bytes()))
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2"]) == 2
    assert capsys.readouterr().err == (
        f"raysb: error: --resume: {out / CHECKPOINT_FILE} cannot be read as a checkpoint: it is cut short, damaged or "
        "not a raysb checkpoint; put back a copy of it, or start the run again with --overwrite\n"
    )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before


def test_the_checkpoint_carries_its_config_past_a_deleted_or_edited_config_yaml(tmp_path, capsys):
    """config.yaml deleted, then `--resume --epochs 2`, once ended in KeyError: 'values'; edited by
    hand to another strategy, the checkpoint once resumed as that strategy without a word."""
    out = tmp_path / "run"
    train(config(out, subset=1000, strategy="sb"), log=lambda line: None)
    (out / "config.yaml").write_text((out / "config.yaml").read_text().replace("strategy: sb", "strategy: uniform"))
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2"]) == 2
    assert capsys.readouterr().err == (
        f"raysb: error: --resume: {out / 'config.yaml'} says strategy=uniform, but the checkpoint in {out} was made "
        "with strategy=sb; a resume continues a run as it was made: put config.yaml back (or delete it: the "
        "checkpoint carries its config), or give another --out for a new run\n"
    )
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before

    (out / "config.yaml").unlink()
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "sb on fashion-mnist (1000 train / 200 test)" in printed
    assert "resumed from the checkpoint after epoch 1" in printed
    assert [row["epoch"] for row in rows_of(out)] == [1, 2]
    assert TrainConfig.load(out / "config.yaml").strategy == "sb"


def test_a_finished_run_whose_checkpoint_was_deleted_says_to_overwrite(tmp_path, capsys):
    """It once said "its run stopped before its first checkpoint: run it again without --resume",
    which was false, and doing so was refused."""
    out = tmp_path / "run"
    train(config(out), log=lambda line: None)
    (out / CHECKPOINT_FILE).unlink()
    assert main(["train", "--out", str(out), "--resume", "--epochs", "2"]) == 2
    assert capsys.readouterr().err == (
        f"raysb: error: --resume: --out {out} holds no checkpoint to continue from; its run ended, but its "
        "checkpoint.pt is gone: --overwrite trains it again from the start\n"
    )
    assert main(["train", "--config", str(out / "config.yaml"), "--overwrite"]) == 0
    assert [row["epoch"] for row in rows_of(out)] == [1]
