"""`raysb to-parquet`: any supported dataset written out in the raysb Parquet format."""

from __future__ import annotations

from pathlib import Path

import torch

from .loading import load_splits
from .parquet import Location, write_parquet
from .sampling import stratified_subset
from .sources import URI_SETTINGS, is_uri, join_location


def export_parquet(
    name: str, out_dir: str | Path, data_dir: str | None = None, subset: int | None = None,
    files: int = 1, encoding: str = "png", seed: int = 0, parquet_columns: dict[str, str] | None = None,
    image_size: int | None = None,
) -> list[Location]:
    """Write a supported dataset's train and test splits as `out_dir/{train,test}.parquet`.

    With `files` > 1 each split becomes a folder of that many files, which Ray
    Data reads in parallel. `subset` takes a stratified subset of the train split.
    The data is read as training reads it (`parquet_columns`, `image_size`: raysb.data.loading), and
    written under raysb's own column names, its images at their new size.
    `out_dir` may be a URI (s3://BUCKET/PREFIX, gs://...) that pyarrow's filesystems write.
    """
    if files < 1:
        raise ValueError(f"files must be >= 1, got {files}")
    train, test = load_splits(name, data_dir, parquet_columns=parquet_columns, image_size=image_size)
    if subset is not None:
        train = stratified_subset(train, subset, seed)
    written = []
    for split, data in (("train", train), ("test", test)):
        target = join_location(out_dir, f"{split}.parquet")
        parts = [(target, data)] if files == 1 else [
            (join_location(target, f"part-{part:04d}.parquet"), data.select(rows))
            for part, rows in enumerate(torch.arange(len(data)).chunk(files))
        ]
        for path, rows in parts:
            try:
                write_parquet(rows, path, encoding)
            except OSError as err:  # a missing bucket, no access, a full disk: the store's own words
                settings = f" ({URI_SETTINGS})" if is_uri(path) else ""
                raise ValueError(f"--out {out_dir}: cannot write {path}: {err}{settings}") from None
            written.append(path)
    return written
