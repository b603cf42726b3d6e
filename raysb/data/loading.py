"""``load_dataset``: one entry point over every supported source."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

from raysb.core.settings import DATASET_NAMES

from .cifar import read_cifar
from .dataset import DataError, ImageDataset, LabeledImages, channel_stats, check_labels
from .image_folder import read_image_folder
from .image_size import IMAGE_SIZE_HINT, resized
from .mnist import read_mnist
from .numpy_arrays import read_numpy
from .parquet import Location, read_parquet_split
from .sources import is_uri
from .svhn import read_svhn

SPLITS = ("train", "test")

# read(split, root, download, image_size, parquet_columns) -> one split, whole, its images image_size x
# image_size where that is given.
Reader = Callable[[str, Location | None, bool, int | None, dict[str, str] | None], LabeledImages]


def _one_size(read: Callable[[str, Path | None, bool], LabeledImages]) -> Reader:
    """A reader of a format whose images share one size: resized whole, once read."""
    def read_resized(split, root, download, image_size, _columns):
        part = read(split, root, download)
        return part._replace(images=resized(part.images, image_size))
    return read_resized


# Keyed by the names the config accepts (raysb.core.settings.DATASET_NAMES).
_READERS: dict[str, Reader] = {
    "fashion-mnist": _one_size(partial(read_mnist, "fashion-mnist")),
    "mnist": _one_size(partial(read_mnist, "mnist")),
    "cifar10": _one_size(partial(read_cifar, "cifar10")),
    "cifar100": _one_size(partial(read_cifar, "cifar100")),
    "svhn": _one_size(read_svhn),
    # User-supplied data, with nothing to download. Images of any size: each resized as it is decoded.
    "parquet": lambda split, root, _download, image_size, columns: read_parquet_split(split, root, columns, image_size),
    "imagefolder": lambda split, root, _download, image_size, _columns: read_image_folder(
        split, root, image_size=image_size),
    "numpy": _one_size(read_numpy),
}


def load_dataset(
    name: str,
    split: str,
    data_dir: str | None = None,
    download: bool = False,
    parquet_columns: dict[str, str] | None = None,
    image_size: int | None = None,
) -> ImageDataset:
    """Load one split of a dataset.

    The train split defines ``num_classes``, ``mean`` and ``std`` for both splits, so loading ``test`` also
    reads ``train``: the test split must be normalized with training statistics, never its own.
    `parquet_columns` names a parquet file's columns for raysb's roles (raysb.data.parquet); `image_size`
    resizes every image to image_size x image_size (raysb.data.image_size).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    read = _split_reader(name, data_dir, download, parquet_columns, image_size)
    part = read(split)
    train = part if split == "train" else read("train")
    return _with_train_statistics(name, split, part, train, channel_stats(train.images, f"{name} train split"))


def load_splits(
    name: str, data_dir: str | None = None, download: bool = False, parquet_columns: dict[str, str] | None = None,
    image_size: int | None = None,
) -> tuple[ImageDataset, ImageDataset]:
    """(train, test), reading the train split once for both."""
    read = _split_reader(name, data_dir, download, parquet_columns, image_size)
    train = read("train")
    test = read("test")
    stats = channel_stats(train.images, f"{name} train split")
    return (
        _with_train_statistics(name, "train", train, train, stats),
        _with_train_statistics(name, "test", test, train, stats),
    )


def _split_reader(
    name: str, data_dir: str | None, download: bool, parquet_columns: dict[str, str] | None, image_size: int | None
) -> Callable[[str], LabeledImages]:
    if name not in _READERS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}")
    read, root = _READERS[name], _root(name, data_dir)
    return lambda split: read(split, root, download, image_size, parquet_columns)


def _root(name: str, data_dir: str | None) -> Location | None:
    """`data_dir` as a local path, or as the URI it is: Path would fold s3://bucket into s3:/bucket."""
    if data_dir is None:
        return None
    if not is_uri(data_dir):
        return Path(data_dir).expanduser()
    if name != "parquet":
        raise DataError(f"data_dir {data_dir}: {name} is read from local files; a URI works for dataset parquet")
    return data_dir


def _with_train_statistics(
    name: str, split: str, part: LabeledImages, train: LabeledImages, stats
) -> ImageDataset:
    if part.images.shape[1:] != train.images.shape[1:]:
        # A size (not a channel count) that differs is what image_size is for.
        hint = f"; {IMAGE_SIZE_HINT}" if part.images.shape[1] == train.images.shape[1] else ""
        raise DataError(
            f"{name}: {split} images are {tuple(part.images.shape[1:])} but train images are "
            f"{tuple(train.images.shape[1:])}{hint}"
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
