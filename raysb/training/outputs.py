"""What a run leaves in its output folder: metrics.parquet, summary.json, config.yaml."""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raysb.chaos import MARKER_PREFIX

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
    "best_model.pt", "best_model.pt.tmp",
    "last_checkpoint.json", "selection_counts.parquet", "loss_cdf.parquet", "tracked_examples.parquet",
    "gradient_similarity.parquet",
)
# Folders a run writes into its --out (raysb.training.metric_sinks' TensorBoard event files).
TENSORBOARD_FOLDER = "tensorboard"
RUN_FOLDERS = (TENSORBOARD_FOLDER,)
# Something to continue: a single process's checkpoint, or the record of a Ray Train run's committed one.
CHECKPOINT_MARKERS = ("checkpoint.pt", "last_checkpoint.json")


# The weights of the epoch with the lowest test error so far (ties: the latest).
BEST_MODEL_FILE = "best_model.pt"


def save_atomically(value, path: Path) -> None:
    """`torch.save` to a temporary file renamed into place: a reader never sees half a file."""
    partial = path.with_name(path.name + ".tmp")
    torch.save(value, partial)
    os.replace(partial, path)


def holds_run(out: Path) -> bool:
    """Whether `out` holds a run that must not be replaced unasked: one with a checkpoint to continue
    from, or one that ended (completed, budget reached or diverged: its summary says so).

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
        raise ValueError(
            f"--out {out} already holds a run; pass --resume to continue it, --overwrite to replace it, "
            "or choose another --out"
        )
    left = any((out / name).exists() for name in RUN_FILES)
    _remove_run_files(out)
    if left and not overwrite:
        return f"raysb: --out {out} held a run that stopped before its first checkpoint; starting it again"
    return None


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
