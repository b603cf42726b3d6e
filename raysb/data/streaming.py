"""Parquet splits read piece by piece, for training sets larger than a worker's memory.

`read_parquet` decodes a whole split into one tensor. Here a split is first
inspected (row count, sample ids, label space, image shape, normalisation
statistics from a sample of rows), then decoded a piece at a time: by Ray Data
tasks while training (`ray_dataset`) and by a pyarrow scan while evaluating
(`StreamedSplit.batches`). Only the ids (8 bytes per example) are held whole,
so per-example state such as Stale-SB's loss table still covers every example.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import torch

from .dataset import channel_stats, check_labels
from .parquet import NUM_CLASSES_KEY, check_columns, check_unique, decode_rows, int_column
from .sources import locate

# Rows decoded up front for the normalisation statistics: enough for a stable
# per-channel mean and std, few enough to stay cheap on any split size.
STATS_ROWS = 10_000
COLUMNS = ("image", "label", "sample_id")


@dataclass(frozen=True)
class StreamedSplit:
    path: Path
    sample_ids: torch.Tensor  # every row's id, in file order
    num_classes: int
    image_shape: tuple[int, int, int]
    # Always the train split's statistics, as for in-memory splits.
    mean: tuple[float, ...]
    std: tuple[float, ...]
    # The split's schema metadata: pieces read on their own may not carry it.
    metadata: dict[bytes, bytes]

    def __len__(self) -> int:
        return self.sample_ids.numel()

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(uint8 images, labels) in file order, at most `batch_size` rows at a time."""
        scan = pads.dataset(self.path, format="parquet").to_batches(
            columns=["image", "label"], batch_size=batch_size
        )
        for piece in scan:
            if piece.num_rows:
                yield decode_rows(self.path, pa.Table.from_batches([piece]), self.metadata)


def inspect_splits(data_dir: str | None) -> tuple[StreamedSplit, StreamedSplit]:
    """(train, test) of the raysb Parquet format under `data_dir`, inspected for streaming."""
    train = inspect_split("train", data_dir)
    return train, inspect_split("test", data_dir, train)


def inspect_split(split: str, data_dir: str | None, train: StreamedSplit | None = None) -> StreamedSplit:
    root = Path(data_dir).expanduser() if data_dir is not None else None
    (path,) = locate(f"parquet {split} split", [root] if root else [], [f"{split}.parquet"])
    dataset = pads.dataset(path, format="parquet")
    check_columns(path, dataset.schema.names, required=COLUMNS)
    metadata = dataset.schema.metadata or {}
    keys = dataset.to_table(columns=["sample_id", "label"])
    if keys.num_rows == 0:
        raise ValueError(f"{path}: no rows")
    sample_ids = int_column(path, keys, "sample_id")
    check_unique(path, sample_ids)
    labels = int_column(path, keys, "label")
    if train is not None:
        num_classes = train.num_classes
    elif NUM_CLASSES_KEY in metadata:
        num_classes = int(metadata[NUM_CLASSES_KEY])
    else:
        num_classes = int(labels.max()) + 1
    check_labels(f"{path}", labels, num_classes)

    sample_rows = 1 if train is not None else STATS_ROWS
    images, _ = decode_rows(path, dataset.head(sample_rows, columns=["image", "label"]), metadata)
    image_shape = tuple(images.shape[1:])
    if train is not None and image_shape != train.image_shape:
        raise ValueError(f"{path}: {split} images are {image_shape} but train images are {train.image_shape}")
    mean, std = (train.mean, train.std) if train is not None else channel_stats(images)
    return StreamedSplit(path, sample_ids, num_classes, image_shape, mean, std, metadata)


def ray_dataset(split: StreamedSplit):
    """The split as a lazily decoded Ray Dataset with columns image (uint8 C,H,W), label, sample_id."""
    import ray.data

    return ray.data.read_parquet(str(split.path)).select_columns(list(COLUMNS)).map_batches(
        partial(_decode_piece, split.path, split.metadata), batch_format="pyarrow"
    )


def _decode_piece(path: Path, metadata: dict[bytes, bytes], table: pa.Table) -> dict[str, np.ndarray]:
    images, labels = decode_rows(path, table, metadata)
    return {
        "image": images.numpy(),
        "label": labels.numpy(),
        "sample_id": int_column(path, table, "sample_id").numpy(),
    }
