"""Datasets as whole-split uint8 tensors, with stable sample ids, and batch-level augmentation."""

from .dataset import DatasetNotFoundError, ImageDataset
from .loading import DATASET_NAMES, load_dataset, load_splits
from .parquet import write_parquet
from .sampling import flip_labels, stratified_subset
from .transforms import BatchTransform

__all__ = [
    "DATASET_NAMES",
    "BatchTransform",
    "DatasetNotFoundError",
    "ImageDataset",
    "flip_labels",
    "load_dataset",
    "load_splits",
    "stratified_subset",
    "write_parquet",
]
