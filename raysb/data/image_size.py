"""Images brought to one size. A model trains on a tensor of equal images, so with `image_size` every
image is resized to image_size x image_size as torchvision's `Resize((N, N))` does (bilinear,
antialiased, the aspect ratio not kept); without it, images of mixed sizes are refused, naming the
sizes found and the option."""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from .dataset import DataError

IMAGE_SIZE_HINT = ("set image_size to resize every image to one size (--image-size N or --set image_size=N, or "
                   "image_size: N in YAML)")


def resized(images: torch.Tensor, size: int | None) -> torch.Tensor:
    """uint8 images, (N, C, H, W) or one (C, H, W), at `size` x `size`; as they are where `size` is None
    or they have it. torch resizes uint8 as torchvision's Resize does, to the same values."""
    if size is None or tuple(images.shape[-2:]) == (size, size):
        return images
    batch = images if images.dim() == 4 else images[None]
    out = F.interpolate(batch, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return out if images.dim() == 4 else out[0]


def stacked(images: list[torch.Tensor], wheres: list[str]) -> torch.Tensor:
    """Decoded (C, H, W) images as one (N, C, H, W) tensor, once they share a shape; `wheres` name them."""
    shapes = Counter(tuple(image.shape) for image in images)
    if len(shapes) == 1:
        return torch.stack(images)
    example: dict[tuple, str] = {}
    for where, image in zip(wheres, images):
        example.setdefault(tuple(image.shape), where)
    if len({shape[0] for shape in shapes}) > 1:
        found = ", ".join(f"{shape[0]} in {count} (e.g. {example[shape]})" for shape, count in shapes.most_common())
        raise DataError(f"images with different numbers of channels: {found}; give every image the same colour mode "
                        "(all grey, or all RGB)")
    found = ", ".join(f"{shape[1]}x{shape[2]} in {count} (e.g. {example[shape]})"
                      for shape, count in shapes.most_common())
    raise DataError(f"images of {len(shapes)} sizes: {found}; {IMAGE_SIZE_HINT}")
