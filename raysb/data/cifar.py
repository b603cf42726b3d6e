"""CIFAR-10 and CIFAR-100 from the pickled batches that torchvision downloads and extracts."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from .dataset import DataError, LabeledImages
from .sources import locate, torchvision_download

# name -> (folder under data_dir, files per split, label key, number of classes, torchvision class)
_VARIANTS = {
    "cifar10": (
        "cifar-10-batches-py",
        {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
        "labels",
        10,
        "CIFAR10",
    ),
    "cifar100": (
        "cifar-100-python",
        {"train": ("train",), "test": ("test",)},
        "fine_labels",
        100,
        "CIFAR100",
    ),
}


def read_cifar(name: str, split: str, data_dir: Path | None, download: bool) -> LabeledImages:
    folder, files, label_key, num_classes, tv_class = _VARIANTS[name]
    paths = locate(
        f"{name} {split} split",
        [data_dir] if data_dir else [],
        [f"{folder}/{file}" for file in files[split]],
        fetch=torchvision_download(tv_class, train=split == "train"),
        data_dir=data_dir,
        download=download,
    )
    batches = [_read_batch(path, label_key) for path in paths]
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    return LabeledImages(
        images=torch.from_numpy(images),
        labels=torch.from_numpy(labels),
        sample_ids=torch.arange(len(labels)),
        num_classes=num_classes,
    )


def _read_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    # The batches were pickled by Python 2: latin1 decodes their str keys to str (the default would fail on
    # their byte strings). Unpickling can run arbitrary code, so data_dir must hold files the user trusts.
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="latin1")
    if not isinstance(batch, dict) or "data" not in batch or label_key not in batch:
        raise DataError(f"{path}: expected a pickled dict with keys 'data' and '{label_key}'")
    data = np.asarray(batch["data"])
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != data.shape[:1]:
        raise DataError(
            f"{path}: expected uint8 data of shape (N, 3072) and N labels, "
            f"got {data.dtype} {data.shape} and {labels.shape[0]} labels"
        )
    # Rows are stored channel-major (1024 red, 1024 green, 1024 blue values), i.e. already C, H, W.
    return data.reshape(-1, 3, 32, 32), labels
