"""`raysb predict RUN --data-dir SOURCE --out FILE`: a trained run's predictions for images as they are
held (raysb.data.unlabelled), one row per image: its id, the predicted class and each class's
probability, written as CSV or Parquet."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import torch

from raysb.config import ConfigError
from raysb.data.unlabelled import read_unlabelled
from raysb.inference import load_model
from raysb.training.outputs import BEST_MODEL_FILE

WRITERS = {".csv": pacsv.write_csv, ".parquet": pq.write_table}


def predict(
    run_dir: str | Path, source: str, out: str | Path, weights: str = BEST_MODEL_FILE, device: str = "auto",
    batch_size: int = 256, parquet_columns: dict[str, str] | None = None,
) -> int:
    """Write `out` (.csv or .parquet) with the predictions of the run in `run_dir` for the images at
    `source`; the number of images."""
    target = Path(out)
    if target.suffix not in WRITERS:
        raise ConfigError(f"--out {out}: predictions are written to a {' or '.join(WRITERS)} file")
    model = load_model(run_dir, weights, device)
    ids, images = read_unlabelled(source, model.info.image_size, parquet_columns)
    probabilities = model.probabilities(images, batch_size)
    target.parent.mkdir(parents=True, exist_ok=True)
    WRITERS[target.suffix](prediction_table(ids, probabilities), str(target))
    return len(ids)


def prediction_table(ids: list, probabilities: torch.Tensor) -> pa.Table:
    """Columns id, predicted_class and probability_K for each class K."""
    columns = {"id": ids, "predicted_class": probabilities.argmax(1).numpy()}
    columns.update({f"probability_{k}": probabilities[:, k].numpy() for k in range(probabilities.shape[1])})
    return pa.table(columns)
