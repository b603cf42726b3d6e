"""The in-memory dataset type shared by every loader, and the checks and statistics built on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from raysb.core.errors import ConfigError


class DataError(ConfigError):
    """A data set's files hold what raysb cannot train on. Refused before training, as a config is:
    `train()` raises it as a ConfigError, and the CLI prints it in one line."""


class DatasetNotFoundError(DataError, FileNotFoundError):
    """The files of a dataset split are not where they were looked for (and were not downloaded)."""


class LabeledImages(NamedTuple):
    """What a format reader produces for one split, before the train-split statistics are attached."""

    images: torch.Tensor  # uint8 (N, C, H, W)
    labels: torch.Tensor  # int64 (N,)
    sample_ids: torch.Tensor  # int64 (N,)
    num_classes: int


@dataclass(frozen=True)
class ImageDataset:
    """A whole split held as tensors, so batches are sliced rather than assembled example by example.

    ``mean``/``std`` always describe the train split (also on the test split) so that both splits are
    normalized identically.
    """

    images: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or not self.images.is_contiguous():
            raise ValueError(
                "images must be a contiguous uint8 tensor of shape (N, C, H, W), got "
                f"{self.images.dtype} {tuple(self.images.shape)}"
            )
        n, channels = self.images.shape[:2]
        for field in ("labels", "sample_ids"):
            tensor = getattr(self, field)
            if tensor.dtype != torch.int64 or tuple(tensor.shape) != (n,):
                raise ValueError(f"{field} must be int64 of shape ({n},), got {tensor.dtype} {tuple(tensor.shape)}")
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(f"mean and std need one value per channel ({channels}), got {self.mean} and {self.std}")

    def __len__(self) -> int:
        return self.images.shape[0]

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images, labels) slices in order, the same interface a streamed split offers."""
        for start in range(0, len(self), batch_size):
            yield self.images[start : start + batch_size], self.labels[start : start + batch_size]

    def select(self, index: torch.Tensor) -> ImageDataset:
        """Rows by position (integer or boolean index); sample ids travel with their rows."""
        return dataclasses.replace(
            self,
            images=self.images[index],
            labels=self.labels[index],
            sample_ids=self.sample_ids[index],
        )


def check_labels(source: str, labels: torch.Tensor, num_classes: int) -> None:
    """Reject labels outside [0, num_classes): they would otherwise surface later as an opaque CUDA assert."""
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if bad.numel():
        values, counts = torch.unique(bad, return_counts=True)
        listed = ", ".join(f"{v} ({c} times)" for v, c in zip(values.tolist()[:10], counts.tolist()[:10]))
        more = f" and {len(values) - 10} more values" if len(values) > 10 else ""
        raise DataError(f"{source}: {bad.numel()} labels outside [0, {num_classes}): {listed}{more}")


def channel_stats(images: torch.Tensor, source: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of ``images / 255``, the training images of `source`;
    a channel of one value throughout is refused: normalising divides by its spread.

    Works from a 256-bin histogram per channel: exact, and it never materializes a float copy of the
    split (which for CIFAR would be over a gigabyte).
    """
    levels = torch.arange(256, dtype=torch.float64)
    means, stds = [], []
    for channel in range(images.shape[1]):
        counts = torch.bincount(images[:, channel].reshape(-1), minlength=256).to(torch.float64)
        total = counts.sum()
        mean = (counts * levels).sum() / total
        var = (counts * levels.square()).sum() / total - mean.square()
        means.append(mean.item() / 255)
        stds.append(var.clamp_min(0).sqrt().item() / 255)
        if stds[-1] == 0:
            raise DataError(f"{source}: every training pixel of channel {channel} is {round(means[-1] * 255)}: "
                            "images of one colour hold nothing to learn, and normalising divides by their spread")
    return tuple(means), tuple(stds)


def inferred_class_count(source, labels: torch.Tensor, how_to_declare: str) -> int:
    """The training label space where the files do not declare it: the largest label + 1, where plausible.
    `how_to_declare` says where the format declares it instead."""
    present = torch.unique(labels)
    inferred = int(present.max()) + 1
    # The model gets one output per class up to the largest label. When more than half of those classes
    # never occur in the training set, a stray label (a typo, a sentinel such as 99 or 255) is far likelier
    # than a label space that sparse, and a model built on it trains without a word of warning. Half leaves
    # room for labels counted from 1 and for a class or two missing from a small set; a set sparse on
    # purpose (a few classes of a larger label space) declares its size.
    if inferred > 2 * present.numel():
        listed = ", ".join(map(str, present.tolist()[:12])) + (", ..." if present.numel() > 12 else "")
        # A -1 ("unlabelled") written into an unsigned column arrives as the type's largest value.
        wrapped = inferred - 1 in (2**8 - 1, 2**16 - 1)
        sentinel = f" ({inferred - 1} is what -1 becomes in an unsigned integer column)" if wrapped else ""
        raise DataError(
            f"{source}: labels go up to {inferred - 1}{sentinel} but only {present.numel()} distinct labels "
            f"occur ({listed}): a {inferred}-class model would never see {inferred - present.numel()} of its "
            f"classes. Number the classes 0..K-1 (drop unlabelled rows), or declare the label space in "
            f"{how_to_declare}"
        )
    return inferred
