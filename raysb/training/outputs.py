"""What a run leaves in its output folder: metrics.parquet, summary.json, config.yaml."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raysb.chaos_spec import MARKER_PREFIX
from raysb.config import ConfigError

METRIC_COLUMNS = (
    "epoch",
    "wall_s",
    "test_error",
    "test_loss",
    "train_loss",
    "selection_forward_examples",
    "train_forward_examples",
    "backprop_examples",
    "optimizer_steps",
    "kept_fraction",
    "lr",
    "time_selection_s",
    "time_train_forward_s",
    "time_backward_s",
    "time_data_s",
    "time_bookkeeping_s",
    "time_other_s",
)


# Everything a run writes into its --out folder (raysb.training.trace's tables, the final
# model, a single process's checkpoint, the record of Ray Train's last committed one).
RUN_FILES = (
    "config.yaml", "metrics.parquet", "summary.json", "checkpoint.pt", "checkpoint.pt.tmp", "model.pt",
    "best_model.pt", "best_model.pt.tmp", "model.json", "model.json.tmp",
    "last_checkpoint.json", "selection_counts.parquet", "loss_cdf.parquet", "tracked_examples.parquet",
    "gradient_similarity.parquet", "label_suspects.parquet", "label_suspects.parquet.tmp",
)
# Folders a run writes into its --out (raysb.training.metric_sinks' TensorBoard event files).
TENSORBOARD_FOLDER = "tensorboard"
RUN_FOLDERS = (TENSORBOARD_FOLDER,)
# raysb tune's record of a trial's status, written beside the run it trains before the run starts.
STATUS_FILE = "trial_status.json"
# Held (flock) by the run writing into an --out, so that no other run, --overwrite included, writes there at once.
LOCK_FILE = ".raysb.lock"
# Something to continue: a single process's checkpoint, or the record of a Ray Train run's committed one.
CHECKPOINT_MARKERS = ("checkpoint.pt", "last_checkpoint.json")


# The weights of the epoch with the lowest test error so far (ties: the latest).
BEST_MODEL_FILE = "best_model.pt"
# Beside them, what inference needs to rebuild the network and its preprocessing (raysb.training.saved_model).
MODEL_INFO_FILE = "model.json"


class OutputWriteError(OSError):
    """A run's file could not be written (a full disk, say); the previous version of it is kept."""


def save_atomically(value, path: Path) -> None:
    """`torch.save` to a temporary file renamed into place: a reader never sees half a file.

    A failed write removes the temporary file and leaves the previous `path` as it was, so a
    resume once there is room continues from it. torch.save is given a Python file so that a
    failed write raises OSError with its errno (to a path, it is a RuntimeError that does not
    say why)."""
    partial = path.with_name(path.name + ".tmp")
    try:
        with open(partial, "wb") as file:
            torch.save(value, file)
    except (OSError, RuntimeError) as error:
        # torch's zip writer may raise a RuntimeError of its own while closing over the failed write.
        failed = error if isinstance(error, OSError) else error.__context__
        if not isinstance(failed, OSError):
            raise
        partial.unlink(missing_ok=True)
        reason = "the disk is full" if failed.errno == errno.ENOSPC else failed.strerror or str(failed)
        kept = f"the previous {path.name} is kept" if path.exists() else f"no {path.name} was written"
        raise OutputWriteError(f"cannot write {path}: {reason}; {kept}") from None
    os.replace(partial, path)


@contextmanager
def holding_out(out: Path, create: bool):
    """Hold --out for this run: create it (when `create`, for a new run) and lock it against every
    other run until the block ends. A folder that cannot be created or written is one line here,
    before anything loads, and so is one that holds other files and no run (a project's own
    folder, say), which nothing asked to become one. Without `create`, a missing folder is left
    to the caller to refuse."""
    if not create and not out.is_dir():
        yield
        return
    foreign = _foreign_files(out) if create else []
    if foreign and not any((out / name).exists() for name in RUN_FILES):
        listed = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ConfigError(
            f"--out {out} holds other files than a run ({listed}); a run writes a dozen files into its --out: "
            "give a new or empty folder"
        )
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / LOCK_FILE, "a")
    except OSError as error:
        a_file = next((path for path in (out, *out.parents) if path.exists() and not path.is_dir()), None)
        reason = f"{a_file} is a file, not a folder" if a_file is not None else error.strerror
        raise ConfigError(f"--out {out} cannot be written: {reason}; choose another --out") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"--out {out} is in use by another run that is writing into it; wait for it to end or choose "
                "another --out"
            ) from None
        try:
            yield  # closing the file releases the lock, as does the process's end however it ends
        finally:
            # A run that failed before writing anything (its data missing, say) leaves no folder behind
            # that holds nothing but the lock.
            if created and [path.name for path in out.iterdir()] == [LOCK_FILE]:
                (out / LOCK_FILE).unlink()
                out.rmdir()


def holds_run(out: Path) -> bool:
    """Whether `out` holds a run that must not be replaced unasked: one with a checkpoint to continue
    from, or one that ended (its epochs or a budget reached, or diverged: its summary says so).

    A run stopped before its first checkpoint (interrupted, killed, or failed on a NaN) leaves
    config.yaml and perhaps some epochs' metrics that nothing can continue. Counting those as a
    run locked the --out: a new run was refused as "already holds a run" and --resume found "no
    checkpoint", so only --overwrite got out. A new run clears them instead (claim_out)."""
    if any((out / name).exists() for name in CHECKPOINT_MARKERS):
        return True
    summary = out / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("status") != "failed"


def claim_out(out: Path, resume: bool, overwrite: bool) -> str | None:
    """Refuse an --out that holds a run unless the user said to continue it or to replace it.
    Replacing removes the files a run writes and nothing else; so does starting again in an --out
    whose run stopped before its first checkpoint, which returns a line saying so."""
    if resume:
        return None
    if holds_run(out) and not overwrite:
        raise ConfigError(
            f"--out {out} already holds a run; pass --resume to continue it, --overwrite to replace it, "
            "or choose another --out"
        )
    left = any((out / name).exists() for name in RUN_FILES)
    _remove_run_files(out)
    if left and not overwrite:
        return f"raysb: --out {out} held a run that stopped before its first checkpoint; starting it again"
    return None


def _foreign_files(out: Path) -> list[str]:
    """What `out` holds besides the files and folders a run writes there."""
    if not out.is_dir():
        return []
    own = {*RUN_FILES, *RUN_FOLDERS, LOCK_FILE, STATUS_FILE}
    return sorted(
        path.name for path in out.iterdir() if path.name not in own and not path.name.startswith(MARKER_PREFIX)
    )


def _remove_run_files(out: Path) -> None:
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for name in RUN_FOLDERS:
        shutil.rmtree(out / name, ignore_errors=True)
    for marker in out.glob(f"{MARKER_PREFIX}*"):
        marker.unlink()


class MetricsWriter:
    """One row per evaluated epoch, rewritten atomically after every row.

    The file on disk is always a complete, readable table, so a run that dies
    (NaN loss, a killed job) keeps every epoch it finished.
    """

    def __init__(self, path: str | Path, rows: list[dict[str, Any]] | None = None):
        self.path = Path(path)
        self.rows = list(rows or [])

    def append(self, row: dict[str, Any]) -> None:
        missing = set(METRIC_COLUMNS) - set(row)
        if missing:
            raise KeyError(f"metrics row lacks {sorted(missing)}")
        self.rows.append(row)
        table = pa.Table.from_pylist(self.rows)
        partial = self.path.with_suffix(".parquet.tmp")
        pq.write_table(table, partial)
        os.replace(partial, self.path)


def read_metrics(path: str | Path, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """A run's metrics rows, read through one open file: a run still writing replaces the file
    whole, and a read that opened it twice by name could take the footer of one version and the
    pages of the next (seen: a worker that outlived its lost cluster wrote another epoch while the
    driver read)."""
    with open(path, "rb") as file:
        return pq.read_table(file, columns=columns).to_pylist()


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    partial = Path(f"{path}.tmp")
    partial.write_text(json.dumps(payload, indent=2, default=_jsonable))
    os.replace(partial, path)


def versions() -> dict[str, str]:
    import numpy
    import pyarrow
    import torch

    from raysb.version import __version__

    found = {
        "raysb": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "pyarrow": pyarrow.__version__,
    }
    try:
        import ray

        found["ray"] = ray.__version__
    except ImportError:
        pass
    return found


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
