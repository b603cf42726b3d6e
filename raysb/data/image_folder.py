"""An ImageFolder: FOLDER/train/CLASS/IMAGE and FOLDER/test/CLASS/IMAGE, one folder of images per class (the
layout of torchvision's ImageFolder and Hugging Face's imagefolder). Classes are numbered in the sorted order
of the train split's class folders, as torchvision numbers them."""

from __future__ import annotations

from pathlib import Path

import torch

from .dataset import DataError, DatasetNotFoundError, LabeledImages
from .parquet import decode_all
from .sources import check_data_dir

# What raysb decodes (raysb.data.parquet.IMAGE_FORMATS); other files in a class folder are not images.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif")
LAYOUT = "an ImageFolder holds FOLDER/train/CLASS/IMAGE and FOLDER/test/CLASS/IMAGE, one folder of images per class"


def read_image_folder(
    split: str, data_dir: Path | None, _download: bool = False, image_size: int | None = None
) -> LabeledImages:
    """One split of the ImageFolder at `data_dir`, decoded whole (each image resized to `image_size` x
    `image_size` where given, raysb.data.image_size)."""
    if data_dir is None:
        raise DatasetNotFoundError(f"imagefolder: give the folder with --data-dir (data_dir= in Python); {LAYOUT}")
    check_data_dir("imagefolder", data_dir)
    classes = class_names(data_dir)
    root = data_dir / split
    if not root.is_dir():
        raise DatasetNotFoundError(f"imagefolder {data_dir}: no {split} folder; {LAYOUT}")
    unknown = sorted(path.name for path in root.iterdir() if path.is_dir() and path.name not in classes)
    if unknown:
        raise DataError(f"imagefolder {data_dir}: {split} has class folders that train has not: {', '.join(unknown)}")
    files = [
        (path, label)
        for label, name in enumerate(classes) if (root / name).is_dir()
        for path in sorted((root / name).iterdir()) if path.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        raise DatasetNotFoundError(f"imagefolder {data_dir}: no images ({', '.join(IMAGE_SUFFIXES)}) in {root}")
    images = decode_all(((str(path), path.read_bytes()) for path, _ in files), image_size)
    labels = torch.tensor([label for _, label in files], dtype=torch.int64)
    return LabeledImages(images, labels, torch.arange(len(files)), len(classes))


def class_names(data_dir: Path) -> list[str]:
    """The classes, in label order: the train split's class folders, sorted."""
    train = data_dir / "train"
    classes = sorted(path.name for path in train.iterdir() if path.is_dir()) if train.is_dir() else []
    if len(classes) < 2:
        raise DatasetNotFoundError(
            f"imagefolder {data_dir}: {len(classes)} class folder(s) in {train}, at least 2 needed; {LAYOUT}"
        )
    return classes
