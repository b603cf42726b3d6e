"""What a user does with --out and its files ends in one line, never in a traceback or in a run
that silently writes where it should not: an --out that cannot be written, an empty --out, a
folder of other files, two runs at once, a full disk while checkpointing."""

import errno
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import raysb.training.outputs
from raysb.api import train
from raysb.cli import main
from raysb.config import TrainConfig
from raysb.data.dataset import DatasetNotFoundError
from raysb.resume import CHECKPOINT_FILE

from conftest import needs_fashion_mnist

pytestmark = needs_fashion_mnist

TINY = ["train", "--dataset", "fashion-mnist", "--subset", "500", "--test-subset", "100", "--batch-size", "50",
        "--set", "model_options.width=8", "--progress-seconds", "0"]


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


def test_an_out_that_is_a_file_or_read_only_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("mine")
    assert main([*TINY, "--epochs", "1", "--out", str(tmp_path / "afile" / "run")]) == 2
    assert capsys.readouterr().err == (
        f"raysb: error: --out {tmp_path / 'afile' / 'run'} cannot be written: {tmp_path / 'afile'} is a file, not a "
        "folder; choose another --out\n"
    )
    assert (tmp_path / "afile").read_text() == "mine"

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main([*TINY, "--epochs", "1", "--out", str(tmp_path / "ro" / "run")]) == 2
    assert capsys.readouterr().err == (
        f"raysb: error: --out {tmp_path / 'ro' / 'run'} cannot be written: Read-only file system; "
        "choose another --out\n"
    )


def test_an_empty_out_or_a_folder_of_other_files_is_refused(tmp_path, capsys, monkeypatch):
    """`--out ''` once wrote a whole run into the current folder: a checkout's own root."""
    (tmp_path / "README.md").write_text("a project")
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--epochs", "1", "--out", ""]) == 2
    assert capsys.readouterr().err == "raysb: error: --out is empty; name the folder for the run's files\n"
    for out in (".", str(tmp_path)):
        assert main([*TINY, "--epochs", "1", "--out", out, "--overwrite"]) == 2
        assert capsys.readouterr().err == (
            f"raysb: error: --out {out} holds other files than a run (README.md); a run writes a dozen files into "
            "its --out: give a new or empty folder\n"
        )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["README.md"]


def test_a_full_disk_while_checkpointing_stops_in_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys,
                                                                                     monkeypatch):
    """A write that fails with ENOSPC, injected into the second checkpoint's file: once two
    chained tracebacks (`basic_ios::clear: iostream error`) and checkpoint.pt.tmp left behind."""
    out = tmp_path / "run"
    opened = []

    class FullDisk:
        def __init__(self, file):
            self.file, self.written = file, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    def open_filling_the_disk(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        if Path(path).name == CHECKPOINT_FILE + ".tmp":
            opened.append(path)
            if len(opened) == 2:
                return FullDisk(file)
        return file

    monkeypatch.setattr(raysb.training.outputs, "open", open_filling_the_disk, raising=False)
    assert main([*TINY, "--epochs", "3", "--out", str(out)]) == 1
    assert capsys.readouterr().err == (
        f"raysb: training stopped: cannot write {out / CHECKPOINT_FILE}: the disk is full; the previous "
        f"{CHECKPOINT_FILE} is kept\n"
    )
    assert not (out / (CHECKPOINT_FILE + ".tmp")).exists()
    assert torch.load(out / CHECKPOINT_FILE, weights_only=False)["epoch"] == 1
    monkeypatch.undo()  # room again: the run continues from the checkpoint that survived
    assert main(["train", "--out", str(out), "--resume"]) == 0
    assert "resumed from the checkpoint after epoch 1" in capsys.readouterr().out
    assert torch.load(out / CHECKPOINT_FILE, weights_only=False)["epoch"] == 3


@pytest.mark.slow
def test_a_live_runs_out_is_locked_against_another_run_overwrite_included(tmp_path, capsys):
    """Two runs into one --out with --overwrite once both ran to the end and exited 0, the
    last writer's files winning."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "raysb", *TINY, "--epochs", "100", "--time-budget", "4", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 120
    while not (out / "config.yaml").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.poll() is None, first.stdout.read()
    assert main([*TINY, "--epochs", "1", "--overwrite", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"raysb: error: --out {out} is in use by another run that is writing into it; wait for it to end or choose "
        "another --out\n"
    )
    output, _ = first.communicate(timeout=300)
    assert first.returncode == 0, output
    assert "time budget of 4s reached" in output
    # Once the first run has ended, its --out is free for --overwrite.
    assert main([*TINY, "--epochs", "1", "--overwrite", "--out", str(out)]) == 0


def test_a_run_that_fails_before_writing_anything_leaves_no_out_folder(tmp_path):
    # A missing data set once left --out holding nothing but the lock file.
    out = tmp_path / "run"
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        train(TrainConfig(dataset="parquet", data_dir=str(tmp_path / "none"), out=str(out), progress_seconds=0),
              log=lambda _: None)
    assert not out.exists()
    # A folder that was there before is left there, empty or not.
    out.mkdir()
    with pytest.raises(DatasetNotFoundError):
        train(TrainConfig(dataset="parquet", data_dir=str(tmp_path / "none"), out=str(out), progress_seconds=0),
              log=lambda _: None)
    assert out.is_dir()
