"""Images to predict on, as they are held: a folder of image files (at any depth, so an ImageFolder's
class folders too), a Parquet file or a folder of them (an `image` column as training reads it, local
or at a URI), or NumPy images in a .npy file or under `images` in a .npz. Each image comes with an id:
its path under the folder, its `sample_id` where the Parquet file has one, else its position."""

from __future__ import annotations

from pathlib import Path

import torch

from .dataset import DataError, DatasetNotFoundError
from .image_folder import IMAGE_SUFFIXES
from .image_size import resized
from .numpy_arrays import images_of_array, load_arrays
from .parquet import Location, decode_all, decode_images, file_column, open_split, sample_ids_of
from .sources import is_uri

SOURCES = ("a folder of images (PNG, JPEG, WebP or GIF, in it or its folders), a .parquet file or a folder of "
           "them, or a .npy/.npz file of images")


def read_unlabelled(
    location: Location, image_size: int | None, columns: dict[str, str] | None = None
) -> tuple[list, torch.Tensor]:
    """(ids, uint8 images (N, C, H, W)) at `location`, each image resized to `image_size` x `image_size`
    where given; `columns` names a Parquet file's image and sample_id columns where it calls them otherwise."""
    if is_uri(location):
        return _parquet(location, image_size, columns)
    path = Path(location).expanduser()
    if not path.exists():
        raise DatasetNotFoundError(f"--data-dir {location} does not exist")
    splits = [name for name in ("train.parquet", "test.parquet") if (path / name).exists()]
    if splits:  # a data set's folder: which split is meant is not for raysb to guess
        raise DataError(f"{path} holds a data set's splits ({', '.join(splits)}): give the one to predict on, "
                        f"e.g. --data-dir {path / splits[-1]}")
    if path.suffix == ".parquet" or path.is_dir() and next(path.rglob("*.parquet"), None) is not None:
        return _parquet(path, image_size, columns)
    if path.suffix in (".npy", ".npz"):
        return _arrays(path, image_size)
    if path.is_dir():
        return _image_files(path, image_size)
    raise DataError(f"{path}: not images raysb reads; give {SOURCES}")


def _parquet(location: Location, image_size: int | None, columns: dict[str, str] | None) -> tuple[list, torch.Tensor]:
    dataset, metadata = open_split(location, columns, required=("image",))
    sample_id = file_column("sample_id", columns)
    has_ids = sample_id in dataset.schema.names
    table = dataset.to_table(columns=[file_column("image", columns)] + ([sample_id] if has_ids else []))
    if table.num_rows == 0:
        raise DataError(f"{location}: no rows")
    images = decode_images(location, table, metadata, columns, image_size)
    return sample_ids_of(location, table, sample_id).tolist(), images


def _arrays(path: Path, image_size: int | None) -> tuple[list, torch.Tensor]:
    arrays = load_arrays(path)
    if isinstance(arrays, dict):
        if "images" not in arrays:
            raise DataError(f"{path}: no array images; it holds {', '.join(arrays) or 'none'}")
        arrays = arrays["images"]
    images = resized(images_of_array(str(path), arrays), image_size)
    return list(range(len(images))), images


def _image_files(folder: Path, image_size: int | None) -> tuple[list, torch.Tensor]:
    files = sorted(path for path in folder.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file())
    if not files:
        raise DataError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in it or its folders; give {SOURCES}")
    images = decode_all(((str(path), path.read_bytes()) for path in files), image_size)
    return [path.relative_to(folder).as_posix() for path in files], images
