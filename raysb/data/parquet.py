"""The raysb Parquet format: how users bring their own image-classification data.

Columns: ``image`` (encoded PNG/JPEG bytes, or a list of uint8 whose C,H,W shape is in the schema metadata
key ``raysb.image_shape``), ``label`` (int) and optional ``sample_id`` (int, defaults to the row index).
Optional schema metadata ``raysb.num_classes`` fixes the label space; otherwise it is max label + 1.
A file whose columns have other names is read with a mapping from these roles to its names
(``parquet_columns: {image: pixels, label: target}``); other columns are ignored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchvision.io import ImageReadMode, decode_image, encode_png

from .dataset import ImageDataset, LabeledImages
from .sources import locate

# What raysb reads from a row, under these names unless `parquet_columns` maps them to others.
COLUMN_ROLES = ("image", "label", "sample_id")
SHAPE_KEY = b"raysb.image_shape"
NUM_CLASSES_KEY = b"raysb.num_classes"
ENCODINGS = ("png", "raw")


def read_parquet_split(split: str, data_dir: Path | None, columns: dict[str, str] | None = None) -> LabeledImages:
    """``<data_dir>/<split>.parquet``, a file or a directory of files."""
    (path,) = locate(f"parquet {split} split", [data_dir] if data_dir else [], [f"{split}.parquet"])
    return read_parquet(path, columns)


def file_column(role: str, columns: dict[str, str] | None) -> str:
    """The file's name for `role` (one of COLUMN_ROLES)."""
    return (columns or {}).get(role, role)


def with_role_names(path: Path, table: pa.Table, columns: dict[str, str] | None) -> pa.Table:
    """`table` with the columns `columns` maps renamed to their roles, the rest as they were."""
    if not columns:
        return table
    missing = [f"{name!r} (parquet_columns {role})" for role, name in columns.items() if name not in table.column_names]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(missing)}; found {table.column_names}")
    roles = {name: role for role, name in columns.items()}
    return table.rename_columns([roles.get(name, name if name not in columns else f"{name} (unused)")
                                 for name in table.column_names])


def read_parquet(path: Path, columns: dict[str, str] | None = None) -> LabeledImages:
    """One split from a Parquet file or a directory of Parquet files."""
    table = with_role_names(path, pq.read_table(path), columns)
    check_columns(path, table.column_names, required=("image", "label"))
    if table.num_rows == 0:
        raise ValueError(f"{path}: no rows")
    metadata = table.schema.metadata or {}
    images, labels = decode_rows(path, table, metadata)
    if "sample_id" in table.column_names:
        sample_ids = int_column(path, table, "sample_id")
        check_unique(path, sample_ids)
    else:
        sample_ids = torch.arange(table.num_rows)
    num_classes = int(metadata[NUM_CLASSES_KEY]) if NUM_CLASSES_KEY in metadata else int(labels.max()) + 1
    return LabeledImages(images, labels, sample_ids, num_classes)


def check_columns(path: Path, found: list[str], required: tuple[str, ...]) -> None:
    missing = [c for c in required if c not in found]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; found {found}")


def decode_rows(path: Path, table: pa.Table, metadata: dict[bytes, bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images (N, C, H, W), int64 labels) of a table or a streamed piece of one.

    `metadata` is the split's schema metadata: a piece read on its own may not carry it.
    """
    return _read_images(path, table.column("image"), metadata), int_column(path, table, "label")


def write_parquet(ds: ImageDataset, path: str | Path, encoding: str = "png") -> None:
    """Write ``ds`` in the raysb Parquet format: ``png`` is compact and lossless, ``raw`` skips decoding on load."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {ENCODINGS}")
    metadata = {NUM_CLASSES_KEY: str(ds.num_classes).encode()}
    if encoding == "png":
        if ds.images.shape[1] not in (1, 3):
            raise ValueError(f"PNG holds 1 or 3 channels, images have {ds.images.shape[1]}; use encoding='raw'")
        image = pa.array([encode_png(img).numpy().tobytes() for img in ds.images], type=pa.binary())
    else:
        image = pa.FixedSizeListArray.from_arrays(pa.array(ds.images.reshape(-1).numpy()), ds.images[0].numel())
        metadata[SHAPE_KEY] = ",".join(map(str, ds.images.shape[1:])).encode()
    table = pa.table(
        {"image": image, "label": pa.array(ds.labels.numpy()), "sample_id": pa.array(ds.sample_ids.numpy())},
        metadata=metadata,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def _read_images(path: Path, column: pa.ChunkedArray, metadata: dict[bytes, bytes]) -> torch.Tensor:
    if column.null_count:
        raise ValueError(f"{path}: {column.null_count} rows have no image")
    kind = column.type
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return _decode_encoded(path, column)
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) and (
        kind.value_type == pa.uint8()
    ):
        return _unflatten_raw(path, column, metadata)
    raise ValueError(f"{path}: column 'image' must be binary (encoded PNG/JPEG) or a list of uint8, got {kind}")


def _decode_encoded(path: Path, column: pa.ChunkedArray) -> torch.Tensor:
    decoded = []
    for row, data in enumerate(column.to_pylist()):
        try:
            image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.UNCHANGED)
        except RuntimeError as err:
            raise ValueError(f"{path}: row {row}: cannot decode image ({err})") from err
        if decoded and image.shape != decoded[0].shape:
            raise ValueError(
                f"{path}: images of unequal shape: row 0 is {tuple(decoded[0].shape)}, row {row} is {tuple(image.shape)}"
            )
        decoded.append(image)
    return torch.stack(decoded)


def _unflatten_raw(path: Path, column: pa.ChunkedArray, metadata: dict[bytes, bytes]) -> torch.Tensor:
    if SHAPE_KEY not in metadata:
        raise ValueError(f"{path}: raw uint8 images need the C,H,W shape in schema metadata {SHAPE_KEY.decode()!r}")
    shape = tuple(int(d) for d in metadata[SHAPE_KEY].decode().split(","))
    if len(shape) != 3:
        raise ValueError(f"{path}: {SHAPE_KEY.decode()} must be 'C,H,W', got {metadata[SHAPE_KEY].decode()!r}")
    array = column.combine_chunks()
    lengths = np.asarray(pc.list_value_length(array))
    wrong = np.flatnonzero(lengths != np.prod(shape))
    if wrong.size:
        raise ValueError(
            f"{path}: images of unequal shape: row {wrong[0]} has {lengths[wrong[0]]} values, "
            f"shape {shape} needs {np.prod(shape)}"
        )
    # flatten() (unlike .values) honours the array's offset when it is a slice of a larger buffer.
    values = array.flatten().to_numpy(zero_copy_only=False)
    return torch.from_numpy(values.reshape(len(array), *shape).copy())


def int_column(path: Path, table: pa.Table, name: str) -> torch.Tensor:
    column = table.column(name)
    if not pa.types.is_integer(column.type):
        raise ValueError(f"{path}: column {name!r} must hold integers, got {column.type}")
    if column.null_count:
        raise ValueError(f"{path}: column {name!r} has {column.null_count} missing values")
    return torch.from_numpy(column.to_numpy().astype(np.int64))


def check_unique(path: Path, sample_ids: torch.Tensor) -> None:
    values, counts = torch.unique(sample_ids, return_counts=True)
    duplicated = values[counts > 1]
    if duplicated.numel():
        raise ValueError(
            f"{path}: {duplicated.numel()} duplicate sample_id values, e.g. {duplicated[:5].tolist()}"
        )
