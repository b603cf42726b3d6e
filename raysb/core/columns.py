"""Named tensor columns packed into bytes and back, for examples that travel between ranks.

A `ColumnSchema` names each column with its dtype and the shape of one row. Every
rank builds the same schema, so a packed block needs no header of its own: its row
count comes with it, and the schema says how the bytes divide.
"""

from __future__ import annotations

import math

import torch

ColumnSchema = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def schema_of(columns: dict[str, torch.Tensor]) -> ColumnSchema:
    """The schema of `columns` (rows along the first dimension)."""
    return {name: (column.dtype, tuple(column.shape[1:])) for name, column in columns.items()}


def bytes_per_row(schema: ColumnSchema) -> int:
    return sum(dtype.itemsize * math.prod(shape) for dtype, shape in schema.values())


def empty_columns(schema: ColumnSchema) -> dict[str, torch.Tensor]:
    return {name: torch.empty((0, *shape), dtype=dtype) for name, (dtype, shape) in schema.items()}


def pack_columns(columns: dict[str, torch.Tensor], schema: ColumnSchema) -> torch.Tensor:
    """One uint8 tensor holding every column of `schema`, in schema order, on the CPU."""
    if set(columns) != set(schema):
        raise ValueError(f"columns {sorted(columns)} do not match the schema's {sorted(schema)}")
    rows = {len(column) for column in columns.values()}
    if len(rows) > 1:
        raise ValueError(f"columns have different numbers of rows: {({n: len(c) for n, c in columns.items()})}")
    parts = []
    for name, (dtype, shape) in schema.items():
        column = columns[name]
        if column.dtype != dtype or tuple(column.shape[1:]) != shape:
            raise ValueError(
                f"column {name!r} is {column.dtype} rows of {tuple(column.shape[1:])}, "
                f"the schema says {dtype} rows of {shape}"
            )
        parts.append(column.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack_columns(packed: torch.Tensor, rows: int, schema: ColumnSchema) -> dict[str, torch.Tensor]:
    """The inverse of `pack_columns` for a block of `rows` rows."""
    columns, offset = {}, 0
    for name, (dtype, shape) in schema.items():
        size = rows * dtype.itemsize * math.prod(shape)
        # clone: a view of another dtype needs its own, aligned storage
        columns[name] = packed[offset : offset + size].clone().view(dtype).reshape(rows, *shape)
        offset += size
    return columns
