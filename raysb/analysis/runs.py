"""`raysb train` run folders as `raysb report` reads them: evaluated epochs, summary, the
trace files the trainer writes when training ends, and the run's data and final model
rebuilt from its config.

Anything a figure needs but a run lacks (an older run without trace files, a dataset
not on this machine) raises `Unavailable`: the report leaves that run or figure out
and says why, where a broken folder (`AnalysisError`) stops it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from raysb.analysis.results import load_run_rows, run_config, run_summary
from raysb.config import ConfigError, TrainConfig
from raysb.core.sample_index import SampleIndex
from raysb.data import BatchTransform, DatasetNotFoundError, ImageDataset
from raysb.data.prepare import prepare_data
from raysb.models import build_model

MODEL_FILE = "model.pt"
SELECTION_COUNTS_FILE = "selection_counts.parquet"
LOSS_CDF_FILE = "loss_cdf.parquet"
TRACKED_EXAMPLES_FILE = "tracked_examples.parquet"
GRADIENT_SIMILARITY_FILE = "gradient_similarity.parquet"
# How a run records the trace files and the model, which it does not by default.
ANALYSIS_FLAG = "recorded with --record-analysis, or record_analysis: true in a config or sweep"
# The columns the report reads from each trace file.
TRACE_COLUMNS = {
    SELECTION_COUNTS_FILE: ("sample_id", "considered", "kept"),
    LOSS_CDF_FILE: ("epoch", "loss"),
    TRACKED_EXAMPLES_FILE: ("epoch", "optimizer_step", "sample_id", "loss", "probability", "kept"),
    GRADIENT_SIMILARITY_FILE: (
        "epoch", "probe_batch", "cosine_kept", "cosine_random", "same_sign_kept", "same_sign_random",
    ),
}


class Unavailable(Exception):
    """Something a figure needs from a run is missing; the message says what, for the report."""


@dataclass(frozen=True)
class Run:
    folder: Path
    # Unique among the runs of one report: the folder name, or parent/name where two share it.
    name: str
    # Evaluated epochs with the run's scalar config columns (strategy, selectivity, ...), as load_trials has them.
    metrics: pd.DataFrame
    config: dict[str, Any]
    # {} when the run has no summary.json yet.
    summary: dict[str, Any]

    @property
    def strategy(self) -> str:
        return str(self.metrics["strategy"].iloc[0])

    @property
    def label_noise(self) -> float:
        return float(self.config.get("label_noise") or 0.0)

    @property
    def selectivity(self) -> float:
        """The resolved expected kept fraction (NaN for a config that does not say)."""
        value = self.config.get("selectivity")
        return math.nan if value is None else float(value)

    def trace(self, file: str) -> pd.DataFrame:
        """One of the trace files as a DataFrame; Unavailable when it is missing, incomplete or empty."""
        path = self.folder / file
        if not path.is_file():
            raise Unavailable(f"no {file} ({ANALYSIS_FLAG})")
        frame = pd.read_parquet(path)
        missing = [column for column in TRACE_COLUMNS[file] if column not in frame.columns]
        if missing:
            raise Unavailable(f"{file} lacks column(s) {', '.join(missing)}")
        if frame.empty:
            raise Unavailable(f"{file} is empty")
        return frame

    def train_config(self) -> TrainConfig:
        try:
            return TrainConfig.from_dict(self.config, source=str(self.folder))
        except ConfigError as error:
            raise Unavailable(f"its config cannot be rebuilt: {error}") from None


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """The runs in `paths`, in order; AnalysisError for a folder that is not a run with metrics."""
    runs = []
    for folder, rows in load_run_rows(paths).items():
        config, _ = run_config(folder)
        name = str(rows["trial_id"].iloc[0])
        runs.append(Run(folder, name, rows.reset_index(drop=True), config, run_summary(folder)))
    return runs


class RebuiltRuns:
    """Runs' data and final models rebuilt from their configs and model.pt.

    Cached, because two figures need each run's test predictions and the runs of a
    sweep usually share their data.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._splits: dict[tuple, tuple[ImageDataset, ImageDataset, torch.Tensor]] = {}
        self._predictions: dict[Path, tuple[np.ndarray, np.ndarray]] = {}

    def splits(self, run: Run) -> tuple[ImageDataset, ImageDataset, torch.Tensor]:
        """(train, test, flipped ids) as the run had them: prepare_data is deterministic in the config."""
        # A report never downloads: the data is on this machine or the figure goes without the run.
        config = dataclasses.replace(run.train_config(), download=False)
        key = (config.dataset, config.data_dir, config.subset, config.test_subset, config.label_noise, config.seed)
        if key not in self._splits:
            try:
                self._splits[key] = prepare_data(config.settings().data, config.batch_size)
            except DatasetNotFoundError as error:
                raise Unavailable(f"its dataset is not on this machine: {error}") from None
        return self._splits[key]

    def training_examples(self, run: Run, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uint8 images (N, C, H, W) and training labels (flipped where the run flipped them) of `sample_ids`."""
        train, _, _ = self.splits(run)
        try:
            rows = SampleIndex(train.sample_ids).rows_of(torch.tensor(sample_ids, dtype=torch.int64))
        except KeyError:
            raise Unavailable(f"{SELECTION_COUNTS_FILE} names sample ids outside the run's training set") from None
        return train.images[rows].numpy(), train.labels[rows].numpy()

    def test_predictions(self, run: Run) -> tuple[np.ndarray, np.ndarray]:
        """Softmax probabilities (N, classes) of the run's final model on its test set, and the labels."""
        if run.folder not in self._predictions:
            self._predictions[run.folder] = self._predict(run)
        return self._predictions[run.folder]

    def _predict(self, run: Run) -> tuple[np.ndarray, np.ndarray]:
        path = run.folder / MODEL_FILE
        if not path.is_file():
            raise Unavailable(f"no {MODEL_FILE} ({ANALYSIS_FLAG})")
        config = run.train_config()
        train, test, _ = self.splits(run)
        _, channels, height, _ = train.images.shape
        model = build_model(config.model, train.num_classes, channels, height, **config.model_options)
        try:
            model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except RuntimeError as error:
            first_line = str(error).splitlines()[0]
            raise Unavailable(f"cannot load {MODEL_FILE} into model {config.model}: {first_line}") from None
        model.to(self.device).eval()
        # The normalisation of training and of the run's own evaluation: train-split statistics.
        transform = BatchTransform(train.mean, train.std)
        probabilities = []
        with torch.inference_mode():
            for images, _ in test.batches(config.eval_batch_size):
                logits = model(transform(images.to(self.device), None, train=False))
                probabilities.append(torch.softmax(logits.float(), dim=1).cpu())
        return torch.cat(probabilities).numpy(), test.labels.numpy()
