"""Parquet splits read piece by piece, for training sets larger than a worker's memory.

`read_parquet` decodes a whole split into one tensor. Here a split is first
inspected (row count, sample ids, label space, image shape, normalisation
statistics from a sample of rows), then decoded a piece at a time: by Ray Data
tasks while training (`ray_dataset`) and by a pyarrow scan while evaluating
(`StreamedSplit.batches`). Only the ids (8 bytes per example) are held whole,
so per-example state such as Stale-SB's loss table still covers every example.
Columns keep the file's names until decoded, so messages name them as the user does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import torch

from .dataset import DataError, channel_stats, check_labels
from .parquet import (
    COLUMN_ROLES,
    Location,
    class_count,
    decode_rows,
    file_column,
    int_column,
    open_split,
    sample_ids_of,
    split_location,
)

# Rows decoded up front for the normalisation statistics: enough for a stable
# per-channel mean and std, few enough to stay cheap on any split size.
STATS_ROWS = 10_000


@dataclass(frozen=True)
class StreamedSplit:
    path: Location  # a local path or a URI
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
    # False: the file has no sample-id column, and a row's id is its position in file order.
    ids_in_file: bool = True

    def __len__(self) -> int:
        return self.sample_ids.numel()

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(uint8 images, labels) in file order, at most `batch_size` rows at a time."""
        names = [file_column(role, self.columns) for role in ("image", "label")]
        scan = pads.dataset(self.path, format="parquet").to_batches(columns=names, batch_size=batch_size)
        for piece in scan:
            if piece.num_rows:
                yield decode_rows(self.path, pa.Table.from_batches([piece]), self.metadata, self.columns)


def inspect_splits(
    data_dir: Location | None, columns: dict[str, str] | None = None
) -> tuple[StreamedSplit, StreamedSplit]:
    """(train, test) of the raysb Parquet format under `data_dir` (a folder or a URI), inspected for streaming."""
    train = inspect_split("train", data_dir, columns=columns)
    return train, inspect_split("test", data_dir, train, columns)


def inspect_split(
    split: str, data_dir: Location | None, train: StreamedSplit | None = None, columns: dict[str, str] | None = None
) -> StreamedSplit:
    location = split_location(split, data_dir)
    dataset, metadata = open_split(location, columns, required=("image", "label"))
    sample_id, label, image = (file_column(role, columns) for role in ("sample_id", "label", "image"))
    # Without an id column (a Hugging Face file) a row's id is its position, as in memory: only labels are read.
    ids_in_file = sample_id in dataset.schema.names
    keys = dataset.to_table(columns=[sample_id, label] if ids_in_file else [label])
    if keys.num_rows == 0:
        raise DataError(f"{location}: no rows")
    sample_ids = sample_ids_of(location, keys, sample_id)
    labels = int_column(location, keys, label)
    num_classes = train.num_classes if train is not None else class_count(location, labels, metadata)
    check_labels(f"{location}", labels, num_classes)

    sample_rows = 1 if train is not None else STATS_ROWS
    images, _ = decode_rows(location, dataset.head(sample_rows, columns=[image, label]), metadata, columns)
    image_shape = tuple(images.shape[1:])
    if train is not None and image_shape != train.image_shape:
        raise DataError(f"{location}: {split} images are {image_shape} but train images are {train.image_shape}")
    mean, std = (train.mean, train.std) if train is not None else channel_stats(images, str(location))
    return StreamedSplit(
        location, sample_ids, num_classes, image_shape, mean, std, metadata, dict(columns or {}), ids_in_file
    )


def ray_dataset(split: StreamedSplit):
    """The split as a lazily decoded Ray Dataset with columns image (uint8 C,H,W), label, sample_id."""
    import ray.data

    names = [file_column(role, split.columns) for role in COLUMN_ROLES]
    if split.ids_in_file:
        dataset = _read_parquet_with_tasks(str(split.path)).select_columns(names)
    else:
        from .row_groups import PositionedRowGroups

        # Read a row group at a time, each knowing its rows' positions, which are their ids.
        source = PositionedRowGroups(split.path, names[:2], names[2], len(split))
        dataset = ray.data.read_datasource(source)
    decode = partial(_decode_piece, split.path, split.metadata, split.columns)
    return dataset.map_batches(decode, batch_format="pyarrow")


def kept_rows(split: StreamedSplit, positions: torch.Tensor, seed: int):
    """The rows of `split` at `positions` (in file order) alone, as `ray_dataset` makes them, their row
    groups in an order `seed` draws: a row group holding none of them is not read, and of the others
    only these rows are decoded."""
    import ray.data

    from .row_groups import PositionedRowGroups

    names = [file_column(role, split.columns) for role in COLUMN_ROLES]
    keep = np.unique(positions.numpy())
    # Without an id column in the file, the source adds one of positions (which are the ids).
    source = PositionedRowGroups(split.path, names if split.ids_in_file else names[:2], names[2], len(split), keep,
                                 shuffle_seed=seed)
    decode = partial(_decode_piece, split.path, split.metadata, split.columns)
    return ray.data.read_datasource(source).map_batches(decode, batch_format="pyarrow")


def read_bytes(split: StreamedSplit):
    """What reading `split`'s rows fetches, in bytes (raysb.data.row_groups.ReadBytes)."""
    from .row_groups import ReadBytes, open_row_groups

    names = [file_column(role, split.columns) for role in COLUMN_ROLES]
    return ReadBytes(open_row_groups(split.path, names if split.ids_in_file else names[:2])[1])


def _read_parquet_with_tasks(path: str):
    """`ray.data.read_parquet(path)` through Ray Data's first datasource, which plans the read once.

    The second (Ray 2.60's default) lists the files again at every execution, each epoch, with
    actors of its own that it starts and kills each time: on 2 cores that cost 4-6 s an epoch of
    a 2,000-row split, 0.25 s with this one (BENCHMARKS.md, "Streamed epochs"). The routing is
    read when `read_parquet` is called, so it is set around the call, not for the whole process.
    """
    import ray.data

    context = ray.data.DataContext.get_current()
    before = context.use_datasource_v2
    context.use_datasource_v2 = False
    try:
        return ray.data.read_parquet(path)
    finally:
        context.use_datasource_v2 = before


def _decode_piece(
    location: Location, metadata: dict[bytes, bytes], columns: dict[str, str], table: pa.Table
) -> dict[str, np.ndarray]:
    """A piece in the file's column names, decoded under raysb's."""
    images, labels = decode_rows(location, table, metadata, columns)
    return {
        "image": images.numpy(),
        "label": labels.numpy(),
        "sample_id": int_column(location, table, file_column("sample_id", columns)).numpy(),
    }
