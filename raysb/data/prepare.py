"""A run's data: the configured splits, subset and label noise, placed on the training device."""

from __future__ import annotations

import dataclasses

import torch

from raysb.config import ConfigError, TrainConfig

from .dataset import ImageDataset
from .loading import load_splits
from .sampling import flip_labels, stratified_subset


def prepare_data(config: TrainConfig) -> tuple[ImageDataset, ImageDataset, torch.Tensor]:
    train_data, test_data = load_splits(config.dataset, config.data_dir, config.download, config.parquet_columns)
    if config.subset is not None:
        train_data = stratified_subset(train_data, _subset_size("subset", config, train_data, "training"), config.seed)
    if config.test_subset is not None:
        test_data = stratified_subset(test_data, _subset_size("test_subset", config, test_data, "test"), config.seed)
    flipped = torch.empty(0, dtype=torch.int64)
    if config.label_noise > 0:
        train_data, flipped = flip_labels(train_data, config.label_noise, config.seed)
    if config.batch_size > len(train_data):
        raise ConfigError(
            f"batch_size {config.batch_size} is larger than the {len(train_data)} training examples"
        )
    return train_data, test_data, flipped


def _subset_size(key: str, config: TrainConfig, data: ImageDataset, split: str) -> int:
    size = getattr(config, key)
    if size > len(data):
        raise ConfigError(f"{key} {size} is more than the {len(data)} {split} examples of {config.dataset}")
    if size < data.num_classes:
        raise ConfigError(f"{key} {size} is fewer than one example for each of the {data.num_classes} classes")
    return size


def to_device(data: ImageDataset, device: torch.device) -> ImageDataset:
    """Small-image datasets live on the device, so a batch is an index, not a copy over PCIe."""
    return dataclasses.replace(
        data,
        images=data.images.to(device),
        labels=data.labels.to(device),
        sample_ids=data.sample_ids.to(device),
    )
