"""The raysb Parquet format: how users bring their own image-classification data.

Columns: ``image`` (encoded PNG, JPEG, WebP or GIF bytes, as they are or in the struct of ``bytes`` and ``path``
that Hugging Face ``datasets`` writes, or a list of uint8 whose C,H,W shape is in the schema metadata key
``raysb.image_shape``), ``label`` (int) and optional ``sample_id`` (int, defaults to the row index).
Optional schema metadata ``raysb.num_classes`` fixes the label space; otherwise it is the largest label + 1,
unless that is implausible (`class_count`). A file whose columns have other names is read with a mapping from
these roles to its names (``parquet_columns: {image: pixels, label: target}``); other columns are ignored, and
messages name the file's own columns. A split is a file or a folder of files, on local disk or at a URI that
pyarrow's filesystems read (``s3://``, ``gs://``, ...).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import torch

from .dataset import DataError, ImageDataset, LabeledImages, inferred_class_count
from .image_size import resized, stacked
from .sources import is_uri, join_location, locate, locate_uri

# What raysb reads from a row, under these names unless `parquet_columns` maps them to others.
COLUMN_ROLES = ("image", "label", "sample_id")
SHAPE_KEY = b"raysb.image_shape"
NUM_CLASSES_KEY = b"raysb.num_classes"
ENCODINGS = ("png", "raw")
# What an image column may hold, for messages. TorchCodec also reads AVIF and HEIC, with system libraries
# a machine may lack.
IMAGE_FORMATS = "PNG, JPEG, WebP or GIF bytes, or lists of uint8 with schema metadata raysb.image_shape = 'C,H,W'"

# Said where no Parquet split is found: the folder may hold images as they come.
FOLDER_HINT = (
    "for a folder of images per class (an ImageFolder: FOLDER/train/CLASS/IMAGE and FOLDER/test/CLASS/IMAGE), "
    "train with --dataset imagefolder --data-dir FOLDER, or convert it with raysb to-parquet --from-folder FOLDER "
    "--out DIR"
)
# A split's place: a local path, or a URI string (a Path would fold s3:// into s3:/).
Location = Path | str


def split_location(split: str, data_dir: Location | None) -> Location:
    """``<data_dir>/<split>.parquet``, a file or a directory of files, local or at a URI."""
    what, name = f"parquet {split} split", f"{split}.parquet"
    if data_dir is not None and is_uri(data_dir):
        return locate_uri(what, join_location(data_dir, name))
    folder = Path(data_dir).expanduser() if data_dir is not None else None
    (path,) = locate(what, [folder] if folder is not None else [], [name], data_dir=folder, install_hint=FOLDER_HINT)
    return path


def read_parquet_split(
    split: str, data_dir: Location | None, columns: dict[str, str] | None = None, image_size: int | None = None
) -> LabeledImages:
    """One split of the raysb Parquet format under `data_dir`, decoded whole (resized to `image_size`
    x `image_size` where given, raysb.data.image_size)."""
    return read_parquet(split_location(split, data_dir), columns, train=split == "train", image_size=image_size)


def file_column(role: str, columns: dict[str, str] | None) -> str:
    """The file's name for `role` (one of COLUMN_ROLES)."""
    return (columns or {}).get(role, role)


def open_split(
    location: Location, columns: dict[str, str] | None, required: tuple[str, ...]
) -> tuple[pads.Dataset, dict[bytes, bytes]]:
    """The split as a pyarrow dataset, and its schema metadata, once every column it is read by is there."""
    dataset = pads.dataset(location, format="parquet")
    check_columns(location, dataset.schema.names, columns, (*required, *(columns or {})))
    return dataset, dataset.schema.metadata or {}


def check_columns(location: Location, found: list[str], columns: dict[str, str] | None, roles) -> None:
    """A missing column is named as the file would name it, with the parquet_columns setting that maps it."""
    missing = [role for role in dict.fromkeys(roles) if file_column(role, columns) not in found]
    if not missing:
        return
    mapped = columns or {}
    named = ", ".join(
        f"{mapped[role]!r} (parquet_columns.{role})" if role in mapped else repr(role) for role in missing
    )
    unmapped = [f"--set parquet_columns.{role}=COLUMN" for role in missing if role not in mapped]
    hint = f"; if the file names it otherwise, say which column it is: {' '.join(unmapped)}" if unmapped else ""
    raise DataError(f"{location}: no column {named}; found {found}{hint}")


def read_parquet(
    location: Location, columns: dict[str, str] | None = None, train: bool = True, image_size: int | None = None
) -> LabeledImages:
    """One split from a Parquet file or a directory of Parquet files.

    The label space is checked on the train split only (`class_count`): a test split may hold a few classes.
    """
    dataset, metadata = open_split(location, columns, required=("image", "label"))
    sample_id = file_column("sample_id", columns)
    has_ids = sample_id in dataset.schema.names
    read = [file_column(role, columns) for role in ("image", "label")] + ([sample_id] if has_ids else [])
    table = dataset.to_table(columns=read)
    if table.num_rows == 0:
        raise DataError(f"{location}: no rows")
    images, labels = decode_rows(location, table, metadata, columns, image_size)
    sample_ids = sample_ids_of(location, table, sample_id)
    num_classes = class_count(location, labels, metadata) if train else int(labels.max()) + 1
    return LabeledImages(images, labels, sample_ids, num_classes)


def class_count(location: Location, labels: torch.Tensor, metadata: dict[bytes, bytes]) -> int:
    """The training label space: schema metadata raysb.num_classes, else the largest label + 1 where plausible."""
    if NUM_CLASSES_KEY in metadata:
        return _declared_classes(location, metadata[NUM_CLASSES_KEY])
    declare = f"schema metadata {NUM_CLASSES_KEY.decode()} (write_parquet writes it)"
    return inferred_class_count(location, labels, declare)


def _declared_classes(location: Location, value: bytes) -> int:
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise DataError(
            f"{location}: schema metadata {NUM_CLASSES_KEY.decode()} must be a positive integer, got {value!r}"
        )
    return count


def decode_rows(
    location: Location, table: pa.Table, metadata: dict[bytes, bytes], columns: dict[str, str] | None,
    image_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images (N, C, H, W), int64 labels) of a table or a streamed piece of one, in the file's names.

    `metadata` is the split's schema metadata: a piece read on its own may not carry it.
    """
    label = file_column("label", columns)
    return decode_images(location, table, metadata, columns, image_size), int_column(location, table, label)


def decode_images(
    location: Location, table: pa.Table, metadata: dict[bytes, bytes], columns: dict[str, str] | None,
    image_size: int | None = None,
) -> torch.Tensor:
    """The table's images as uint8 (N, C, H, W), resized to `image_size` where given."""
    image = file_column("image", columns)
    return _read_images(location, image, table.column(image), metadata, image_size)


def write_parquet(ds: ImageDataset, path: Location, encoding: str = "png", row_group_size: int | None = None) -> None:
    """Write ``ds`` in the raysb Parquet format: ``png`` is compact and lossless, ``raw`` skips decoding on load.

    `path` may be a URI (s3://, gs://, ...) that pyarrow's filesystems write. `row_group_size`: rows per row
    group (None: pyarrow's default, up to a million); a streamed epoch that reads only the rows it keeps
    skips whole row groups, so smaller ones let it skip more.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {ENCODINGS}")
    metadata = {NUM_CLASSES_KEY: str(ds.num_classes).encode()}
    if encoding == "png":
        # Imported where images are encoded: raw data (a GPU machine's benchmarks) needs no codec.
        from torchcodec.encoders import PngEncoder

        if ds.images.shape[1] not in (1, 3):
            raise ValueError(f"PNG holds 1 or 3 channels, images have {ds.images.shape[1]}; use encoding='raw'")
        image = pa.array([PngEncoder(img).to_tensor().numpy().tobytes() for img in ds.images], type=pa.binary())
    else:
        image = pa.FixedSizeListArray.from_arrays(pa.array(ds.images.reshape(-1).numpy()), ds.images[0].numel())
        metadata[SHAPE_KEY] = ",".join(map(str, ds.images.shape[1:])).encode()
    table = pa.table(
        {"image": image, "label": pa.array(ds.labels.numpy()), "sample_id": pa.array(ds.sample_ids.numpy())},
        metadata=metadata,
    )
    if not is_uri(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path), row_group_size=row_group_size)


def _read_images(
    location: Location, name: str, column: pa.ChunkedArray, metadata: dict[bytes, bytes], image_size: int | None
) -> torch.Tensor:
    if pa.types.is_struct(column.type) and column.type.get_field_index("bytes") >= 0:
        # Hugging Face datasets' Image feature: a struct of the encoded bytes and the path they came
        # from, which says nothing raysb needs once the bytes are in the file.
        column = pc.struct_field(column, "bytes")
    if column.null_count:
        raise DataError(f"{location}: column {name!r}: {column.null_count} rows have no image")
    kind = column.type
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return _decode_encoded(location, name, column, image_size)
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) and (
        kind.value_type == pa.uint8()
    ):
        return resized(_unflatten_raw(location, name, column, metadata), image_size)
    raise DataError(f"{location}: column {name!r} holds {kind}; images must be {IMAGE_FORMATS}")


def _decode_encoded(location: Location, name: str, column: pa.ChunkedArray, image_size: int | None) -> torch.Tensor:
    rows = ((f"{location}: column {name!r} row {row}", data) for row, data in enumerate(column.to_pylist()))
    return decode_all(rows, image_size)


def decode_all(images, image_size: int | None = None) -> torch.Tensor:
    """(where, encoded bytes) pairs decoded into one uint8 (N, C, H, W) tensor, each resized to
    `image_size` where given; `where` names an image in a message (a file's row, or an image file)."""
    decoded, wheres = [], []
    for where, data in images:
        decoded.append(resized(decode_one(where, data), image_size))
        wheres.append(where)
    return stacked(decoded, wheres)


def decode_one(where: str, data: bytes) -> torch.Tensor:
    """One encoded image as uint8 (C, H, W); a palette image comes out as its colours."""
    # Imported where images are decoded: raw data (a GPU machine's benchmarks) needs no codec.
    from torchcodec.decoders import decode_image

    try:
        image = decode_image(data, mode="UNCHANGED")
    except (RuntimeError, ValueError) as err:
        # TorchCodec's own message starts with a source path of its C++ build: the formats say more.
        raise DataError(f"{where}: not an image raysb decodes; images must be {IMAGE_FORMATS}") from err
    if image.dim() != 3:  # animated GIF/WebP: (frames, C, H, W)
        raise DataError(f"{where}: an animated image of {image.shape[0]} frames; one image a row")
    return image


def _unflatten_raw(
    location: Location, name: str, column: pa.ChunkedArray, metadata: dict[bytes, bytes]
) -> torch.Tensor:
    key = SHAPE_KEY.decode()
    if SHAPE_KEY not in metadata:
        raise DataError(
            f"{location}: column {name!r} holds raw uint8 lists, which need their C,H,W shape in schema metadata "
            f"{key!r} (e.g. '1,28,28'; raysb.data.write_parquet(..., encoding='raw') writes it)"
        )
    shape = tuple(int(d) for d in metadata[SHAPE_KEY].decode().split(","))
    if len(shape) != 3:
        raise DataError(f"{location}: {key} must be 'C,H,W', got {metadata[SHAPE_KEY].decode()!r}")
    array = column.combine_chunks()
    lengths = np.asarray(pc.list_value_length(array))
    wrong = np.flatnonzero(lengths != np.prod(shape))
    if wrong.size:
        raise DataError(
            f"{location}: column {name!r}: images of unequal shape: row {wrong[0]} has {lengths[wrong[0]]} values, "
            f"shape {shape} needs {np.prod(shape)}"
        )
    # flatten() (unlike .values) honours the array's offset when it is a slice of a larger buffer.
    values = array.flatten().to_numpy(zero_copy_only=False)
    return torch.from_numpy(values.reshape(len(array), *shape).copy())


def int_column(location: Location, table: pa.Table, name: str) -> torch.Tensor:
    column = table.column(name)
    if not pa.types.is_integer(column.type):
        raise DataError(f"{location}: column {name!r} must hold integers, got {column.type}")
    if column.null_count:
        raise DataError(f"{location}: column {name!r} has {column.null_count} missing values")
    return torch.from_numpy(column.to_numpy().astype(np.int64))


def sample_ids_of(location: Location, table: pa.Table, name: str) -> torch.Tensor:
    """The split's ids: column `name` (unique integers), or where the file has none, each row's position in file
    order (the order of `pyarrow.dataset.dataset(location).to_table()`), in memory and streamed alike."""
    if name not in table.column_names:
        return torch.arange(table.num_rows)
    sample_ids = int_column(location, table, name)
    check_unique(location, name, sample_ids)
    return sample_ids


def check_unique(location: Location, name: str, sample_ids: torch.Tensor) -> None:
    values, counts = torch.unique(sample_ids, return_counts=True)
    duplicated = values[counts > 1]
    if duplicated.numel():
        raise DataError(
            f"{location}: column {name!r}: {duplicated.numel()} duplicate sample ids, e.g. {duplicated[:5].tolist()}"
        )
