"""NumPy arrays as people save them: DIR/train.npz and DIR/test.npz, each holding arrays `images` and
`labels` (`np.savez(path, images=..., labels=...)`, with `num_classes=K` where the label space is sparse
on purpose), or DIR/train_images.npy with DIR/train_labels.npy (and test_...). Images are uint8 (or
integers within 0..255), (N, H, W) grey or (N, H, W, C) channels-last as NumPy, PIL and Keras hold them,
or (N, C, H, W); labels are integers 0..K-1, (N,) or (N, 1) as Keras saves them. A row's id is its
position."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .dataset import DataError, DatasetNotFoundError, LabeledImages, inferred_class_count
from .sources import check_data_dir

LAYOUT = ("DIR/train.npz and DIR/test.npz with arrays images and labels (np.savez(path, images=..., labels=...)), "
          "or DIR/train_images.npy, DIR/train_labels.npy, DIR/test_images.npy and DIR/test_labels.npy")
# An image's channel axis holds this many values; the other axes are its height and width.
CHANNEL_COUNTS = (1, 3, 4)


def read_numpy(split: str, data_dir: Path | None, _download: bool = False) -> LabeledImages:
    """One split of the arrays in `data_dir`, whole."""
    if data_dir is None:
        raise DatasetNotFoundError(f"numpy: give the folder with --data-dir (data_dir= in Python); it holds {LAYOUT}")
    check_data_dir(f"numpy {split} split", data_dir)
    images, labels, declared, where = _arrays(split, data_dir)
    images = images_of_array(where, images)
    labels = _as_labels(where, labels, images.shape[0])
    if split != "train":  # a test split may hold a few of the classes
        num_classes = int(labels.max()) + 1
    elif declared is not None:
        num_classes = declared
    else:
        num_classes = inferred_class_count(where, labels, "train.npz as num_classes (np.savez(..., num_classes=K))")
    return LabeledImages(images, labels, torch.arange(len(labels)), num_classes)


def _arrays(split: str, data_dir: Path) -> tuple[np.ndarray, np.ndarray, int | None, str]:
    """(images, labels, declared class count or None, the file to name in messages)."""
    archive = data_dir / f"{split}.npz"
    pair = (data_dir / f"{split}_images.npy", data_dir / f"{split}_labels.npy")
    if archive.is_file():
        arrays = load_arrays(archive)
        missing = [name for name in ("images", "labels") if name not in arrays]
        if missing:
            raise DataError(f"{archive}: no array {' or '.join(missing)}; it holds {', '.join(arrays) or 'none'}; "
                            "save it as np.savez(path, images=..., labels=...)")
        return arrays["images"], arrays["labels"], _declared(archive, arrays.get("num_classes")), str(archive)
    if all(path.is_file() for path in pair):
        return load_arrays(pair[0]), load_arrays(pair[1]), None, str(pair[0])
    raise DatasetNotFoundError(f"numpy {split} split not found in {data_dir}: it holds {LAYOUT}")


def load_arrays(path: Path):
    """A .npy's array, or a .npz's arrays by name, read whole. Pickled objects are refused: loading one runs
    code the file chose."""
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            return loaded
        with loaded:
            return {name: loaded[name] for name in loaded.files}
    except (ValueError, OSError, EOFError) as error:
        raise DataError(f"{path}: not NumPy arrays raysb reads: {error}") from None


def _declared(where: Path, value: np.ndarray | None) -> int | None:
    if value is None:
        return None
    if value.shape != () or not np.issubdtype(value.dtype, np.integer) or int(value) < 1:
        raise DataError(f"{where}: num_classes must be one positive integer, got {value!r}")
    return int(value)


def images_of_array(where: str, images: np.ndarray) -> torch.Tensor:
    """uint8 (N, C, H, W)."""
    if images.ndim == 0 or len(images) == 0:
        raise DataError(f"{where}: no images")
    if images.dtype != np.uint8:
        if np.issubdtype(images.dtype, np.integer):
            low, high = int(images.min()), int(images.max())
            if low < 0 or high > 255:
                # 16-bit or scaled pixels: how to bring them to 0..255 depends on their range, which is theirs.
                # Scaled in floats (integer pixels times 255 overflow their own type) and by the range pixels
                # can take, not this file's, so every split and every image to predict on scale alike.
                raise DataError(f"{where}: images are {images.dtype} with pixels from {low} to {high}; raysb trains "
                                "on uint8 pixels 0..255: rescale them to it, e.g. ((images - L) * (255 / (M - L)))"
                                ".round().astype(np.uint8), L and M the least and largest values your pixels can "
                                "take (0 and 65535 for 16-bit images), the same for every split")
        elif np.issubdtype(images.dtype, np.floating):
            raise DataError(f"{where}: images are {images.dtype}; raysb trains on uint8 pixels 0..255 "
                            "(for floats in [0, 1]: save (images * 255).round().astype(np.uint8))")
        else:
            raise DataError(f"{where}: images are {images.dtype}; raysb trains on uint8 pixels 0..255")
        images = images.astype(np.uint8)
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4 and images.shape[3] in CHANNEL_COUNTS:
        images = images.transpose(0, 3, 1, 2)
    elif images.ndim != 4 or images.shape[1] not in CHANNEL_COUNTS:
        raise DataError(f"{where}: images of shape {images.shape}; give (N, H, W), (N, H, W, C) or (N, C, H, W) "
                        f"with C one of {', '.join(map(str, CHANNEL_COUNTS))}")
    return torch.from_numpy(np.ascontiguousarray(images))


def _as_labels(where: str, labels: np.ndarray, count: int) -> torch.Tensor:
    """int64 (N,)."""
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if not np.issubdtype(labels.dtype, np.integer) or labels.shape != (count,):
        raise DataError(f"{where}: labels must be {count} integers, one per image, (N,) or (N, 1); got "
                        f"{labels.dtype} of shape {labels.shape}")
    return torch.from_numpy(labels.astype(np.int64))
