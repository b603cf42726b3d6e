"""Augmentation and normalization of a whole batch at once, as tensor ops on whichever device holds it.

Per-example PIL transforms would make the data pipeline, not the model, the bottleneck: Selective-Backprop
runs a forward pass over every candidate example, so batches are large and must be prepared quickly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from raysb.core.transfer import to_device


class BatchTransform:
    """uint8 (B, C, H, W) -> normalized float32; random crop, horizontal flip and cutout only when training.

    Random numbers are drawn on the generator's device (CPU when none is given) and then moved to the
    batch, so a seed gives the same augmentation whether the batch lives on the CPU or a GPU.
    """

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        crop_padding: int = 0,
        horizontal_flip: bool = False,
        cutout_length: int = 0,
    ) -> None:
        if len(mean) != len(std) or not mean:
            raise ValueError(f"mean and std need one value per channel, got {mean} and {std}")
        if min(std) <= 0:
            raise ValueError(f"std must be positive, got {std}")
        if crop_padding < 0 or cutout_length < 0:
            raise ValueError(f"crop_padding and cutout_length must be >= 0, got {crop_padding} and {cutout_length}")
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.crop_padding = crop_padding
        self.horizontal_flip = horizontal_flip
        self.cutout_length = cutout_length

    def __call__(self, images_uint8: torch.Tensor, generator: torch.Generator | None, train: bool) -> torch.Tensor:
        if images_uint8.dtype != torch.uint8 or images_uint8.dim() != 4:
            raise ValueError(f"expected uint8 images (B, C, H, W), got {images_uint8.dtype} {tuple(images_uint8.shape)}")
        if images_uint8.shape[1] != self.mean.shape[1]:
            raise ValueError(f"images have {images_uint8.shape[1]} channels, mean/std have {self.mean.shape[1]}")
        x = images_uint8
        if train and self.crop_padding:
            x = random_crop(x, self.crop_padding, generator)
        if train and self.horizontal_flip:
            x = random_horizontal_flip(x, generator)
        if self.mean.device != x.device:  # moved once, not copied for every batch
            self.mean, self.std = self.mean.to(x.device), self.std.to(x.device)
        x = normalize(x, self.mean, self.std)
        if train and self.cutout_length:
            x = cutout(x, self.cutout_length, generator)
        return x


def normalize(images_uint8: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    mean, std = mean.to(images_uint8.device), std.to(images_uint8.device)
    return (images_uint8.float() / 255 - mean) / std


def random_crop(images: torch.Tensor, padding: int, generator: torch.Generator | None) -> torch.Tensor:
    """Zero-pad (black, as torchvision's RandomCrop) by ``padding`` and cut each image back at a random offset."""
    b, c, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    offsets = _randint(2 * padding + 1, (2, b), generator, images.device)
    rows = offsets[0, :, None] + torch.arange(h, device=images.device)  # (B, H)
    cols = offsets[1, :, None] + torch.arange(w, device=images.device)  # (B, W)
    padded = padded.gather(2, rows[:, None, :, None].expand(b, c, h, padded.shape[3]))
    return padded.gather(3, cols[:, None, None, :].expand(b, c, h, w))


def random_horizontal_flip(images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Mirror each image left-right with probability 1/2."""
    flip = _randint(2, (images.shape[0],), generator, images.device).bool()
    return torch.where(flip[:, None, None, None], images.flip(3), images)


def cutout(images: torch.Tensor, length: int, generator: torch.Generator | None) -> torch.Tensor:
    """Zero a ``length`` x ``length`` square per image (DeVries & Taylor, 2017).

    The centre is uniform over the image, so squares near the border are clipped: the paper found letting the
    patch leave the image matters. Zero is the dataset mean once normalized, so the patch carries no signal.
    """
    b, _, h, w = images.shape
    top = _randint(h, (b,), generator, images.device) - length // 2
    left = _randint(w, (b,), generator, images.device) - length // 2
    ys = torch.arange(h, device=images.device)
    xs = torch.arange(w, device=images.device)
    in_rows = (ys >= top[:, None]) & (ys < top[:, None] + length)  # (B, H)
    in_cols = (xs >= left[:, None]) & (xs < left[:, None] + length)  # (B, W)
    return images.masked_fill((in_rows[:, :, None] & in_cols[:, None, :])[:, None], 0.0)


def _randint(high: int, size: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    source = generator.device if generator is not None else torch.device("cpu")
    return to_device(torch.randint(high, size, generator=generator, device=source), device)
