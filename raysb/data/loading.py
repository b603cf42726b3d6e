"""``load_dataset``: one entry point over every supported source."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from .cifar import read_cifar
from .dataset import ImageDataset, LabeledImages, channel_stats, check_labels
from .image_folder import read_image_folder
from .mnist import read_mnist
from .parquet import Location, read_parquet_split
from .sources import is_uri
from .svhn import read_svhn

SPLITS = ("train", "test")


_READERS: dict[str, Callable[[str, Location | None, bool], LabeledImages]] = {
    "fashion-mnist": partial(read_mnist, "fashion-mnist"),
    "mnist": partial(read_mnist, "mnist"),
    "cifar10": partial(read_cifar, "cifar10"),
    "cifar100": partial(read_cifar, "cifar100"),
    "svhn": read_svhn,
    # User-supplied data: there is nothing to download.
    "parquet": lambda split, data_dir, _download: read_parquet_split(split, data_dir),
    "imagefolder": read_image_folder,
}
DATASET_NAMES = tuple(_READERS)


def load_dataset(
    name: str,
    split: str,
    data_dir: str | None = None,
    download: bool = False,
    parquet_columns: dict[str, str] | None = None,
) -> ImageDataset:
    """Load one split of a dataset.

    The train split defines ``num_classes``, ``mean`` and ``std`` for both splits, so loading ``test`` also
    reads ``train``: the test split must be normalized with training statistics, never its own.
    `parquet_columns` names a parquet file's columns for raysb's roles (raysb.data.parquet).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    read, root = _reader(name, data_dir, parquet_columns)
    part = read(split, root, download)
    train = part if split == "train" else read("train", root, download)
    return _with_train_statistics(name, split, part, train, channel_stats(train.images))


def load_splits(
    name: str, data_dir: str | None = None, download: bool = False, parquet_columns: dict[str, str] | None = None
) -> tuple[ImageDataset, ImageDataset]:
    """(train, test), reading the train split once for both."""
    read, root = _reader(name, data_dir, parquet_columns)
    train = read("train", root, download)
    test = read("test", root, download)
    stats = channel_stats(train.images)
    return (
        _with_train_statistics(name, "train", train, train, stats),
        _with_train_statistics(name, "test", test, train, stats),
    )


def _reader(name: str, data_dir: str | None, parquet_columns: dict[str, str] | None = None):
    if name not in _READERS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}")
    read = _READERS[name]
    if name == "parquet" and parquet_columns:
        read = lambda split, data_dir, _download: read_parquet_split(split, data_dir, parquet_columns)  # noqa: E731
    return read, _root(name, data_dir)


def _root(name: str, data_dir: str | None) -> Location | None:
    """`data_dir` as a local path, or as the URI it is: Path would fold s3://bucket into s3:/bucket."""
    if data_dir is None:
        return None
    if not is_uri(data_dir):
        return Path(data_dir).expanduser()
    if name != "parquet":
        raise ValueError(f"data_dir {data_dir}: {name} is read from local files; a URI works for dataset parquet")
    return data_dir


def _with_train_statistics(
    name: str, split: str, part: LabeledImages, train: LabeledImages, stats
) -> ImageDataset:
    if part.images.shape[1:] != train.images.shape[1:]:
        raise ValueError(
            f"{name}: {split} images are {tuple(part.images.shape[1:])} but train images are {tuple(train.images.shape[1:])}"
        )
    check_labels(f"{name} {split} split", part.labels, train.num_classes)
    mean, std = stats
    return ImageDataset(
        images=part.images,
        labels=part.labels,
        sample_ids=part.sample_ids,
        num_classes=train.num_classes,
        mean=mean,
        std=std,
    )
