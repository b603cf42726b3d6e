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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import torch

from .dataset import channel_stats, check_labels
from .parquet import (
    COLUMN_ROLES,
    NUM_CLASSES_KEY,
    check_columns,
    check_unique,
    decode_rows,
    file_column,
    int_column,
    with_role_names,
)
from .sources import locate

# Rows decoded up front for the normalisation statistics: enough for a stable
# per-channel mean and std, few enough to stay cheap on any split size.
STATS_ROWS = 10_000


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
    # The file's column for each role where it is not named so (raysb.data.parquet).
    columns: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.sample_ids.numel()

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(uint8 images, labels) in file order, at most `batch_size` rows at a time."""
        names = [file_column(role, self.columns) for role in ("image", "label")]
        scan = pads.dataset(self.path, format="parquet").to_batches(columns=names, batch_size=batch_size)
        for piece in scan:
            if piece.num_rows:
                table = pa.Table.from_batches([piece]).rename_columns(["image", "label"])
                yield decode_rows(self.path, table, self.metadata)


def inspect_splits(
    data_dir: str | None, columns: dict[str, str] | None = None
) -> tuple[StreamedSplit, StreamedSplit]:
    """(train, test) of the raysb Parquet format under `data_dir`, inspected for streaming."""
    train = inspect_split("train", data_dir, columns=columns)
    return train, inspect_split("test", data_dir, train, columns)


def inspect_split(
    split: str, data_dir: str | None, train: StreamedSplit | None = None, columns: dict[str, str] | None = None
) -> StreamedSplit:
    root = Path(data_dir).expanduser() if data_dir is not None else None
    (path,) = locate(f"parquet {split} split", [root] if root else [], [f"{split}.parquet"])
    dataset = pads.dataset(path, format="parquet")
    with_role_names(path, dataset.schema.empty_table(), columns)  # a mapped name the file lacks fails here
    check_columns(path, dataset.schema.names, required=[file_column(role, columns) for role in COLUMN_ROLES])
    metadata = dataset.schema.metadata or {}
    keys = read_roles(dataset, ["sample_id", "label"], columns)
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
    images, _ = decode_rows(path, read_roles(dataset, ["image", "label"], columns, sample_rows), metadata)
    image_shape = tuple(images.shape[1:])
    if train is not None and image_shape != train.image_shape:
        raise ValueError(f"{path}: {split} images are {image_shape} but train images are {train.image_shape}")
    mean, std = (train.mean, train.std) if train is not None else channel_stats(images)
    return StreamedSplit(path, sample_ids, num_classes, image_shape, mean, std, metadata, dict(columns or {}))


def read_roles(dataset: pads.Dataset, roles: list[str], columns: dict[str, str] | None, rows: int | None = None):
    """`roles`' columns of `dataset` (all rows, or the first `rows`), under their role names."""
    names = [file_column(role, columns) for role in roles]
    table = dataset.to_table(columns=names) if rows is None else dataset.head(rows, columns=names)
    return table.rename_columns(roles)


def ray_dataset(split: StreamedSplit):
    """The split as a lazily decoded Ray Dataset with columns image (uint8 C,H,W), label, sample_id."""
    import ray.data

    names = {file_column(role, split.columns): role for role in COLUMN_ROLES}
    dataset = ray.data.read_parquet(str(split.path)).select_columns(list(names))
    if split.columns:
        dataset = dataset.rename_columns(names)
    return dataset.map_batches(partial(_decode_piece, split.path, split.metadata), batch_format="pyarrow")


def _decode_piece(path: Path, metadata: dict[bytes, bytes], table: pa.Table) -> dict[str, np.ndarray]:
    images, labels = decode_rows(path, table, metadata)
    return {
        "image": images.numpy(),
        "label": labels.numpy(),
        "sample_id": int_column(path, table, "sample_id").numpy(),
    }
