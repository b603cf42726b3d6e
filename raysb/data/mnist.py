"""MNIST and Fashion-MNIST from their IDX files (the Debian package, a flat folder, or torchvision's layout)."""

from __future__ import annotations

from pathlib import Path

import torch

from .dataset import DataError, LabeledImages
from .idx import read_idx
from .sources import check_data_dir, locate, torchvision_download

_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# name -> (system folder read where no data_dir is given, torchvision dataset class, whose files live in
# <root>/<class name>/raw)
_VARIANTS = {
    "fashion-mnist": (Path("/usr/share/datasets/fashion-mnist"), "FashionMNIST"),
    "mnist": (None, "MNIST"),
}


def read_mnist(name: str, split: str, data_dir: Path | None, download: bool) -> LabeledImages:
    system_dir, tv_class = _VARIANTS[name]
    # A --data-dir given is the copy to read, never quietly the system's (a mistyped one trained on it).
    if data_dir is not None and not download:
        check_data_dir(name, data_dir)
    dirs = [data_dir, data_dir / tv_class / "raw"] if data_dir else [system_dir] if system_dir else []
    images_path, labels_path = locate(
        f"{name} {split} split",
        dirs,
        _FILES[split],
        suffixes=(".gz", ""),
        fetch=torchvision_download(tv_class, train=split == "train"),
        data_dir=data_dir,
        download=download,
        install_hint=f"apt-get install dataset-{name}" if system_dir else None,
    )
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.dtype != "uint8":
        raise DataError(f"{images_path}: expected uint8 images of shape (N, H, W), got {images.dtype} {images.shape}")
    if labels.shape != images.shape[:1]:
        raise DataError(f"{labels_path}: {labels.shape} labels for {images.shape[0]} images in {images_path}")
    return LabeledImages(
        images=torch.from_numpy(images).unsqueeze(1),
        labels=torch.from_numpy(labels).long(),
        sample_ids=torch.arange(len(labels)),
        num_classes=10,
    )
