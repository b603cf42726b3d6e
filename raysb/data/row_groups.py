"""A Parquet split read by row groups, as a Ray Data source that knows each row's position.

A row's position is its place in file order, counted as `pyarrow.dataset.dataset(...).to_table()`
reads (files as the dataset lists them, then row groups): each read item is a file's row group with
the position of its first row. Two reads need that:

- a split without a sample-id column, whose ids are the rows' positions, as in memory
  (raysb.data.parquet): Ray Data's `read_parquet` tasks do not know where their rows stand in the
  split, so each block here carries ids ``offset + arange(rows)`` under the sample-id column's name;
- an epoch that reads only the rows it keeps (`keep`, their positions: raysb.data.streaming.kept_rows):
  a row group holding none of them is not read at all, and of one that holds some only those rows
  leave the read task, so only they are decoded.

Decoding stays where `ray_dataset` puts it, so every path makes the same rows.
`RowGroup.read_bytes` is what reading a row group's columns fetches (its column chunks, compressed,
as the files' metadata says): what an epoch's reads cost in bytes (`ReadBytes`).
Imported only where a Ray Dataset is built: it imports Ray Data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from .parquet import Location
from .sources import is_uri


@dataclass(frozen=True)
class RowGroup:
    path: str  # the file, in the split's filesystem
    index: int  # the row group within the file
    offset: int  # the split's row position of its first row
    rows: int
    size_bytes: int  # uncompressed, as the file's metadata says
    read_bytes: int  # the read columns' chunks as stored (compressed): what reading them fetches


def row_groups(dataset: pads.FileSystemDataset, columns: list[str]) -> list[RowGroup]:
    """The split's non-empty row groups in file order, from the files' metadata (no rows are read);
    `columns`: those a read takes (a struct column's every field)."""
    groups, offset = [], 0
    for fragment in dataset.get_fragments():
        metadata = fragment.metadata
        for index in range(metadata.num_row_groups):
            group = metadata.row_group(index)
            if group.num_rows:
                chunks = (group.column(i) for i in range(group.num_columns))
                read = sum(chunk.total_compressed_size for chunk in chunks if _read_by(chunk.path_in_schema, columns))
                groups.append(RowGroup(fragment.path, index, offset, group.num_rows, group.total_byte_size, read))
            offset += group.num_rows
    return groups


def _read_by(path_in_schema: str, columns: list[str]) -> bool:
    return any(path_in_schema == name or path_in_schema.startswith(f"{name}.") for name in columns)


def open_row_groups(location: Location, columns: list[str]) -> tuple[pads.FileSystemDataset, list[RowGroup]]:
    """The split at `location` and its row groups (`row_groups`)."""
    # Ray's workers start in folders of their own: a local path must not depend on this one's.
    dataset = pads.dataset(location if is_uri(location) else Path(location).resolve(), format="parquet")
    return dataset, row_groups(dataset, columns)


class ReadBytes:
    """What reading rows of a split fetches, in bytes, from its row groups' `read_bytes`."""

    def __init__(self, groups: list[RowGroup]):
        self.starts = torch.tensor([group.offset for group in groups], dtype=torch.int64)
        self.rows = torch.tensor([group.rows for group in groups], dtype=torch.int64)
        self.bytes = torch.tensor([group.read_bytes for group in groups], dtype=torch.float64)

    def groups_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The row group holding each row at `positions`."""
        return torch.searchsorted(self.starts, positions, right=True) - 1

    def of_groups(self, positions: torch.Tensor) -> int:
        """The bytes a read of the rows at `positions` fetches: every row group holding one, whole."""
        return int(self.bytes[self.groups_of(positions).unique()].sum())

    def of_rows(self, positions: torch.Tensor) -> float:
        """The rows' share of a read of the whole split, each row its row group's bytes over its rows:
        the whole split's bytes over all the rows, however ranks and chunks divide them."""
        groups = self.groups_of(positions)
        return float((self.bytes[groups] / self.rows[groups]).sum())


class PositionedRowGroups(Datasource):
    """`columns` of the split at `location`: a block per row group, or, of kept rows alone, a block per
    read task's row groups of one file. Where `id_column` is not among `columns` (the file has no such
    column), it is added, holding each row's position in the split.
    `keep`: the positions of the only rows to read (ascending); None: every row. `shuffle_seed`: the row
    groups are read in an order this seed draws (None: file order)."""

    def __init__(self, location: Location, columns: list[str], id_column: str, expected_rows: int,
                 keep: np.ndarray | None = None, shuffle_seed: int | None = None):
        super().__init__()
        dataset, groups = open_row_groups(location, columns)
        # Kept instead of the dataset, which Ray pickles with the plan: only what the read tasks need.
        self._filesystem, self._schema = dataset.filesystem, dataset.schema
        self._columns, self._id_column = columns, id_column
        found = sum(group.rows for group in groups)
        if found != expected_rows:
            # The ids were counted when the split was inspected: positions counted now would not match them.
            raise ValueError(f"{location}: {found} rows now, {expected_rows} when inspected; did the files change?")
        self._groups, self._kept_rows = _kept(groups, keep)
        if shuffle_seed is not None:
            # Drawn here, not by Ray Data's randomize_block_order, which holds every block back until the
            # read ends: an epoch of kept rows streams to training as it is read.
            drawn = np.random.default_rng(shuffle_seed).permutation(len(self._groups))
            self._groups = [self._groups[i] for i in drawn]
            self._kept_rows = None if self._kept_rows is None else [self._kept_rows[i] for i in drawn]

    def estimate_inmemory_data_size(self) -> int:
        return sum(group.size_bytes for group in self._groups)

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context=None
    ) -> list[ReadTask]:
        # Consecutive row groups to a task (drawn ones where a seed shuffled them), tasks in that order: the
        # dataset's blocks come in file order, as read_parquet's do, for the ordered execution and the seeded
        # block order to act on.
        parts = np.array_split(np.arange(len(self._groups)), min(max(parallelism, 1), len(self._groups)))
        schema = self._schema
        positioned = self._id_column not in self._columns
        read_schema = pa.schema([schema.field(name) for name in self._columns]
                                + ([(self._id_column, pa.int64())] if positioned else []))
        tasks = []
        for part in parts:
            part = sorted(part, key=lambda i: self._groups[i].offset)  # a task reads its row groups in file order
            groups = [self._groups[i] for i in part]
            kept_rows = None if self._kept_rows is None else [self._kept_rows[i] for i in part]
            metadata = BlockMetadata(
                num_rows=sum(group.rows for group in groups) if kept_rows is None else sum(map(len, kept_rows)),
                size_bytes=sum(group.size_bytes for group in groups),
                exec_stats=None,
                input_files=tuple(dict.fromkeys(group.path for group in groups)),
            )
            read = _Read(self._filesystem, schema, self._columns, self._id_column if positioned else None, groups,
                         kept_rows)
            tasks.append(ReadTask(read, metadata, schema=read_schema, per_task_row_limit=per_task_row_limit))
        return tasks


def _kept(groups: list[RowGroup], keep: np.ndarray | None) -> tuple[list[RowGroup], list[np.ndarray] | None]:
    """The row groups holding a row at the positions `keep` (ascending; None: every row and group), and
    each one's kept rows, counted from its first."""
    if keep is None:
        return groups, None
    starts = np.array([group.offset for group in groups], dtype=np.int64)
    stops = starts + np.array([group.rows for group in groups], dtype=np.int64)
    bounds = np.stack([np.searchsorted(keep, starts), np.searchsorted(keep, stops)], axis=1)
    held = [i for i, (low, high) in enumerate(bounds) if high > low]
    return [groups[i] for i in held], [keep[bounds[i, 0]:bounds[i, 1]] - starts[i] for i in held]


@dataclass(frozen=True)
class _Read:
    """One read task's row groups, reopened on a Ray worker through the split's own filesystem."""

    filesystem: pafs.FileSystem
    schema: pa.Schema  # the split's, so each file's columns read as the whole split's do
    columns: list[str]
    id_column: str | None  # the column of positions to add; None: the file holds the ids
    groups: list[RowGroup]
    kept_rows: list[np.ndarray] | None  # each group's rows to yield; None: all

    def __call__(self):
        split_schema = pa.schema([self.schema.field(name) for name in self.columns])
        for run in _runs_of_one_file(self.groups):
            groups = [self.groups[number] for number in run]
            # A file opened once for its row groups: opened again for each (10 ms or more a row group), an
            # epoch of kept rows in 16-row groups read slower than every row. read_row_groups keeps their
            # order, which a pyarrow fragment of many row groups did not (it began partway and wrapped).
            with self.filesystem.open_input_file(groups[0].path) as handle:
                table = pq.ParquetFile(handle).read_row_groups([g.index for g in groups], columns=self.columns)
            table = table.cast(split_schema)  # each file's columns read as the whole split's do
            rows = np.array([group.rows for group in groups])
            if table.num_rows != rows.sum():
                raise ValueError(f"{groups[0].path}: row groups {[g.index for g in groups]} hold {table.num_rows} "
                                 f"rows, not {rows.sum()}")
            if self.id_column is not None:
                positions = np.concatenate([np.arange(g.offset, g.offset + g.rows, dtype=np.int64) for g in groups])
                table = table.append_column(self.id_column, pa.array(positions))
            starts = np.cumsum(rows) - rows
            if self.kept_rows is None:
                yield from (table.slice(start, count) for start, count in zip(starts, rows))
            else:
                # Before decoding, which follows the read (raysb.data.streaming): the rows left out are never decoded.
                kept = np.concatenate([self.kept_rows[number] + start for number, start in zip(run, starts)])
                yield table.take(pa.array(kept))


def _runs_of_one_file(groups: list[RowGroup]) -> list[list[int]]:
    """The places of `groups` (in file order) in runs of one file each."""
    runs: list[list[int]] = []
    for number, group in enumerate(groups):
        if runs and groups[runs[-1][-1]].path == group.path:
            runs[-1].append(number)
        else:
            runs.append([number])
    return runs
