"""SVHN (cropped digits) from the MATLAB files that torchvision downloads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.io
import torch

from .dataset import DataError, LabeledImages
from .sources import locate, torchvision_download


def read_svhn(split: str, data_dir: Path | None, download: bool) -> LabeledImages:
    (path,) = locate(
        f"svhn {split} split",
        [data_dir] if data_dir else [],
        [f"{split}_32x32.mat"],
        fetch=torchvision_download("SVHN", split=split),
        data_dir=data_dir,
        download=download,
    )
    mat = scipy.io.loadmat(path)
    if "X" not in mat or "y" not in mat:
        raise DataError(f"{path}: expected MATLAB variables 'X' and 'y', found {sorted(k for k in mat if not k.startswith('__'))}")
    x, y = mat["X"], mat["y"].reshape(-1).astype(np.int64)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[2] != 3 or x.shape[3] != len(y):
        raise DataError(f"{path}: expected uint8 X of shape (H, W, 3, N) with N = {len(y)} labels, got {x.dtype} {x.shape}")
    # The digit 0 is stored as class 10 (MATLAB's 1-based habit); everything else is already its digit.
    y[y == 10] = 0
    return LabeledImages(
        images=torch.from_numpy(np.ascontiguousarray(x.transpose(3, 2, 0, 1))),
        labels=torch.from_numpy(y),
        sample_ids=torch.arange(len(y)),
        num_classes=10,
    )
