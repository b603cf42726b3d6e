"""A run's data: the configured splits, subset, label noise and held-out split, placed on the training device."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raysb.core.errors import ConfigError
from raysb.core.settings import DataSettings

from .dataset import ImageDataset
from .loading import load_splits
from .sampling import flip_labels, stratified_split, stratified_subset, without_ids

# Each draw over the training rows has a stream of its own. Two draws of the same length from one seed
# are the same permutation: the first epoch's order (the run's seed itself, raysb.training.engine) once
# was the label noise's, so its first 20% of steps trained on nothing but the flipped examples and
# selection then lost the model (BENCHMARKS.md, "Label noise drawn as the first epoch's order").
# Drawn from the seed too, the held-out split would hold out mostly flipped examples.
HOLDOUT_SEED_OFFSET = 5
LABEL_NOISE_SEED_OFFSET = 6


def prepare_data(data: DataSettings, batch_size: int) -> tuple[ImageDataset, ImageDataset, torch.Tensor]:
    """The splits `data` names, subset and label noise applied and the excluded samples left out of
    training, and the ids whose labels were flipped; a batch of `batch_size` must fit in the training split."""
    train_data, test_data = load_splits(
        data.dataset, data.data_dir, data.download, data.parquet_columns, data.image_size
    )
    if data.subset is not None:
        train_data = stratified_subset(train_data, _subset_size("subset", data, train_data, "training"), data.seed)
    if data.test_subset is not None:
        test_data = stratified_subset(test_data, _subset_size("test_subset", data, test_data, "test"), data.seed)
    flipped = torch.empty(0, dtype=torch.int64)
    if data.label_noise > 0:
        train_data, flipped = flip_labels(train_data, data.label_noise, data.seed + LABEL_NOISE_SEED_OFFSET)
    if data.exclude_samples is not None:
        # After the label noise, so a run can leave out the very labels an earlier run's noise flipped.
        train_data = without_ids(train_data, excluded_sample_ids(data.exclude_samples))
    if batch_size > len(train_data):
        raise ConfigError(f"batch_size {batch_size} is larger than the {len(train_data)} training examples")
    return train_data, test_data, flipped


def excluded_sample_ids(path: str | Path) -> torch.Tensor:
    """The sample ids a file names to leave out of training: a Parquet or CSV file with a `sample_id`
    column (a run folder's label_suspects.parquet, or a user's own list)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"exclude_samples: no file at {path} (a run folder's label_suspects.parquet, or a "
                          "Parquet or CSV file with a sample_id column)")
    try:
        if path.suffix == ".csv":
            from pyarrow import csv

            table = csv.read_csv(path)
        else:
            table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise ConfigError(f"exclude_samples: {path} is not a readable Parquet or CSV file ({error})") from None
    if "sample_id" not in table.column_names:
        raise ConfigError(f"exclude_samples: {path} has no sample_id column (its columns: {table.column_names})")
    return torch.tensor(table.column("sample_id").to_pylist(), dtype=torch.int64)


def split_holdout(
    data: DataSettings, train_data: ImageDataset, batch_size: int
) -> tuple[ImageDataset, ImageDataset | None]:
    """The training split less its held-out share (`data.held_out_share`, which the strategy asks for),
    and that share: seeded and stratified, drawn after the subset and the label noise (a held-out
    example is noisy as often as a trained one), never trained on; None where nothing is held out."""
    if data.held_out_share == 0:
        return train_data, None
    size = round(data.held_out_share * len(train_data))
    if size < train_data.num_classes:
        raise ConfigError(f"a held-out share of {data.held_out_share:g} of {len(train_data)} training examples is "
                          f"{size}, fewer than one example for each of the {train_data.num_classes} classes")
    train_data, holdout = stratified_split(train_data, size, data.seed + HOLDOUT_SEED_OFFSET)
    if batch_size > len(train_data):
        raise ConfigError(f"batch_size {batch_size} is larger than the {len(train_data)} training examples left "
                          f"beside the held-out {len(holdout)}")
    return train_data, holdout


def _subset_size(key: str, settings: DataSettings, split_data: ImageDataset, split: str) -> int:
    size = getattr(settings, key)
    if size > len(split_data):
        raise ConfigError(f"{key} {size} is more than the {len(split_data)} {split} examples of {settings.dataset}")
    if size < split_data.num_classes:
        raise ConfigError(f"{key} {size} is fewer than one example for each of the {split_data.num_classes} classes")
    return size


def to_device(data: ImageDataset, device: torch.device) -> ImageDataset:
    """Small-image datasets live on the device, so a batch is an index, not a copy over PCIe."""
    return dataclasses.replace(
        data,
        images=data.images.to(device),
        labels=data.labels.to(device),
        sample_ids=data.sample_ids.to(device),
    )
