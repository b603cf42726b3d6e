"""Augmentation and normalization of a whole batch at once, as tensor ops on whichever device holds it.

Per-example PIL transforms would make the data pipeline, not the model, the bottleneck: Selective-Backprop
runs a forward pass over every candidate example, so batches are large and must be prepared quickly.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

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
        if train and (self.crop_padding or self.horizontal_flip):
            x = random_crop_and_flip(x, self.crop_padding, self.horizontal_flip, generator)
        if self.mean.device != x.device:  # moved once, not copied for every batch
            self.mean, self.std = self.mean.to(x.device), self.std.to(x.device)
        x = normalize(x, self.mean, self.std)
        if train and self.cutout_length:
            x = cutout(x, self.cutout_length, generator)
        return x

    def with_draws(self, images_uint8: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """Training inputs cropped and flipped by `draws`, `crop_and_flip_draws`' (3, B) rows on the images'
        device (a captured round draws them outside its graph, into one buffer), then normalized. No
        cutout: a transform with one draws as it goes (`__call__`)."""
        if self.cutout_length:
            raise ValueError("a transform with cutout draws as it augments: call it, not with_draws")
        x = images_uint8
        if self.crop_padding or self.horizontal_flip:
            x = crop_and_flip(x, self.crop_padding, draws[:2] if self.crop_padding else None,
                              draws[2] if self.horizontal_flip else None)
        if self.mean.device != x.device:
            self.mean, self.std = self.mean.to(x.device), self.std.to(x.device)
        return normalize(x, self.mean, self.std)


def normalize(images_uint8: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    mean, std = mean.to(images_uint8.device), std.to(images_uint8.device)
    return (images_uint8.float() / 255 - mean) / std


def random_crop(images: torch.Tensor, padding: int, generator: torch.Generator | None) -> torch.Tensor:
    """Zero-pad (black, as torchvision's RandomCrop) by ``padding`` and cut each image back at a random offset."""
    return random_crop_and_flip(images, padding, False, generator)


def random_horizontal_flip(images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Mirror each image left-right with probability 1/2."""
    return random_crop_and_flip(images, 0, True, generator)


def random_crop_and_flip(images: torch.Tensor, padding: int, flip: bool,
                         generator: torch.Generator | None) -> torch.Tensor:
    """`random_crop` by ``padding`` (if any), then `random_horizontal_flip` (if `flip`), drawn in that order,
    as one gather of the padded batch (`crop_and_flip`)."""
    offsets, flipped = crop_and_flip_draws(len(images), padding, flip, generator)
    return crop_and_flip(images, padding, to_device(offsets, images.device) if padding else None,
                         to_device(flipped, images.device) if flip else None)


def crop_and_flip_draws(rows: int, padding: int, flip: bool, generator: torch.Generator | None,
                        out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The crop offsets (2, rows) where `padding`, then the flips (rows,) where `flip`, drawn in that order
    on the generator's device: what `crop_and_flip` reads. `out`: an int64 (3, rows) tensor whose rows
    0-1 and 2 receive them (a captured round's staging buffer), the same draws as without it."""
    source = generator.device if generator is not None else torch.device("cpu")
    offsets = flipped = None
    if padding:
        offsets = torch.randint(2 * padding + 1, (2, rows), generator=generator, device=source,
                                out=None if out is None else out[:2])
    if flip:
        flipped = torch.randint(2, (rows,), generator=generator, device=source, out=None if out is None else out[2])
    return offsets, flipped


def crop_and_flip(images: torch.Tensor, padding: int, offsets: torch.Tensor | None,
                  flipped: torch.Tensor | None) -> torch.Tensor:
    """`images` zero-padded by `padding`, each cut back at its `offsets` (rows: top, left) and mirrored
    where `flipped` is 1, all on the images' device: one gather, each output pixel's place in its padded
    image a cached grid (mirrored where flipped) plus the image's offset. Eight operations where cropping
    then flipping took twelve: outside a CUDA graph each is a launch (BENCHMARKS.md, the CPU launch count)."""
    b, c, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding)) if padding else images
    grids = _pixel_grids(h, w, padded.shape[3], images.device)
    index = grids[flipped] if flipped is not None else grids[0].expand(b, h, w)
    if offsets is not None:
        index = index + (offsets[0] * padded.shape[3] + offsets[1])[:, None, None]
    index = index.reshape(b, 1, h * w).expand(b, c, h * w)
    return padded.flatten(2).gather(2, index).view(b, c, h, w)


@lru_cache(maxsize=16)
def _pixel_grids(height: int, width: int, padded_width: int, device: torch.device) -> torch.Tensor:
    """(2, H, W): each pixel's flat place in a padded image whose top-left crop it is, as it is and mirrored."""
    rows = torch.arange(height, device=device)[:, None] * padded_width
    cols = torch.arange(width, device=device)
    return torch.stack([rows + cols, rows + cols.flip(0)])


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
