"""Seeded ways to derive experimental variants of a dataset: smaller subsets and noisy labels."""

from __future__ import annotations

import dataclasses

import torch

from .dataset import ImageDataset


def stratified_subset(ds: ImageDataset, size: int, seed: int) -> ImageDataset:
    """``size`` rows drawn at random within each class, class counts proportional to ``ds`` (within one).

    Quotas use largest-remainder rounding in exact integer arithmetic; rows keep their original order.
    """
    return ds.select(_stratified_rows(ds, size, seed))


def stratified_split(ds: ImageDataset, size: int, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """``ds`` split in two: the rest, and ``size`` rows drawn as ``stratified_subset`` draws them."""
    held = torch.zeros(len(ds), dtype=torch.bool)
    held[_stratified_rows(ds, size, seed)] = True
    return ds.select(~held), ds.select(held)


def _stratified_rows(ds: ImageDataset, size: int, seed: int) -> torch.Tensor:
    """The ascending rows of ``stratified_subset``'s draw."""
    if not ds.num_classes <= size <= len(ds):
        raise ValueError(f"subset size must be in [{ds.num_classes}, {len(ds)}] (num_classes, len(ds)), got {size}")
    counts = torch.bincount(ds.labels, minlength=ds.num_classes)
    quotas, remainders = (counts * size).div(len(ds), rounding_mode="floor"), (counts * size) % len(ds)
    # The classes with the largest remainders get the rows that flooring left over; ties go to lower class ids.
    leftover = size - int(quotas.sum())
    quotas[torch.sort(remainders, descending=True, stable=True).indices[:leftover]] += 1

    generator = torch.Generator().manual_seed(seed)
    # Shuffle, then group by class without disturbing the shuffle: the first quota rows of each group are a
    # uniform sample of that class.
    shuffled = torch.randperm(len(ds), generator=generator)
    grouped = shuffled[torch.sort(ds.labels[shuffled], stable=True).indices]
    class_starts = torch.cumsum(counts, 0) - counts
    labels = ds.labels[grouped]
    rank_in_class = torch.arange(len(ds)) - class_starts[labels]
    chosen = grouped[rank_in_class < quotas[labels]]
    return torch.sort(chosen).values


def flip_labels(ds: ImageDataset, fraction: float, seed: int) -> tuple[ImageDataset, torch.Tensor]:
    """Give ``round(fraction * len(ds))`` random rows a label drawn uniformly from the *other* classes.

    Returns the noisy dataset and the sample ids of the flipped rows (in row order), so experiments can tell
    whether Selective-Backprop keeps choosing the mislabeled examples.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    if ds.num_classes < 2:
        raise ValueError("flipping labels needs at least 2 classes")
    n_flip = round(fraction * len(ds))
    generator = torch.Generator().manual_seed(seed)
    rows = torch.sort(torch.randperm(len(ds), generator=generator)[:n_flip]).values
    # Adding 1..K-1 modulo K reaches every other class exactly once, so the new label is uniform and never the old.
    shift = torch.randint(1, ds.num_classes, (n_flip,), generator=generator)
    labels = ds.labels.clone()
    labels[rows] = (labels[rows] + shift) % ds.num_classes
    return dataclasses.replace(ds, labels=labels), ds.sample_ids[rows]


def without_ids(ds: ImageDataset, sample_ids: torch.Tensor) -> ImageDataset:
    """``ds`` less the rows whose sample id is in ``sample_ids`` (ids it does not hold are ignored)."""
    return ds.select(~torch.isin(ds.sample_ids, sample_ids.to(ds.sample_ids.device)))
