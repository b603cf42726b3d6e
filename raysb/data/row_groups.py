"""A Parquet split without a sample-id column, as a Ray Data source that knows each row's position.

In memory such a split's ids are the rows' positions in file order (raysb.data.parquet). Ray Data's
`read_parquet` tasks do not know where their rows stand in the split, so the split is read here one
row group at a time instead: each read item is a file's row group with the position of its first row,
counted in the order `pyarrow.dataset.dataset(...).to_table()` reads (files as the dataset lists them,
then row groups), and each block it yields carries ids ``offset + arange(rows)`` under the sample-id
column's name. Decoding stays where `ray_dataset` puts it, so both paths make the same rows.
Imported only where a Ray Dataset is built: it imports Ray Data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
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


def row_groups(dataset: pads.FileSystemDataset) -> list[RowGroup]:
    """The split's non-empty row groups in file order, from the files' metadata (no rows are read)."""
    groups, offset = [], 0
    for fragment in dataset.get_fragments():
        metadata = fragment.metadata
        for index in range(metadata.num_row_groups):
            group = metadata.row_group(index)
            if group.num_rows:
                groups.append(RowGroup(fragment.path, index, offset, group.num_rows, group.total_byte_size))
            offset += group.num_rows
    return groups


class PositionedRowGroups(Datasource):
    """`columns` of the split at `location`, a block per row group, with column `id_column` holding
    each row's position in the split."""

    def __init__(self, location: Location, columns: list[str], id_column: str, expected_rows: int):
        super().__init__()
        # Ray's workers start in folders of their own: a local path must not depend on this one's.
        dataset = pads.dataset(location if is_uri(location) else Path(location).resolve(), format="parquet")
        # Kept instead of the dataset, which Ray pickles with the plan: only what the read tasks need.
        self._filesystem, self._schema, self._groups = dataset.filesystem, dataset.schema, row_groups(dataset)
        self._columns, self._id_column = columns, id_column
        found = sum(group.rows for group in self._groups)
        if found != expected_rows:
            # The ids were counted when the split was inspected: positions counted now would not match them.
            raise ValueError(f"{location}: {found} rows now, {expected_rows} when inspected; did the files change?")

    def estimate_inmemory_data_size(self) -> int:
        return sum(group.size_bytes for group in self._groups)

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context=None
    ) -> list[ReadTask]:
        # Consecutive row groups to a task, tasks in file order: the dataset's blocks come in file order,
        # as read_parquet's do, for the ordered execution and the seeded block order to act on.
        parts = np.array_split(np.arange(len(self._groups)), min(max(parallelism, 1), len(self._groups)))
        schema = self._schema
        read_schema = pa.schema([schema.field(name) for name in self._columns] + [(self._id_column, pa.int64())])
        tasks = []
        for part in parts:
            groups = [self._groups[i] for i in part]
            metadata = BlockMetadata(
                num_rows=sum(group.rows for group in groups),
                size_bytes=sum(group.size_bytes for group in groups),
                exec_stats=None,
                input_files=tuple(dict.fromkeys(group.path for group in groups)),
            )
            read = _Read(self._filesystem, schema, self._columns, self._id_column, groups)
            tasks.append(ReadTask(read, metadata, schema=read_schema, per_task_row_limit=per_task_row_limit))
        return tasks


@dataclass(frozen=True)
class _Read:
    """One read task's row groups, reopened on a Ray worker through the split's own filesystem."""

    filesystem: pafs.FileSystem
    schema: pa.Schema  # the split's, so each file's columns read as the whole split's do
    columns: list[str]
    id_column: str
    groups: list[RowGroup]

    def __call__(self):
        parquet = pads.ParquetFileFormat()
        for group in self.groups:
            fragment = parquet.make_fragment(group.path, self.filesystem, row_groups=[group.index])
            table = fragment.to_table(schema=self.schema, columns=self.columns)
            if table.num_rows != group.rows:
                raise ValueError(f"{group.path}: row group {group.index} holds {table.num_rows} rows, not {group.rows}")
            ids = pa.array(np.arange(group.offset, group.offset + group.rows, dtype=np.int64))
            yield table.append_column(self.id_column, ids)
