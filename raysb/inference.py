"""A trained run as a model to use: `load_model(run_dir)` rebuilds the network from the run folder's
model.json and weights, with the preprocessing its training images had (raysb.training.saved_model)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch
from torch import nn

from raysb.config import ConfigError
from raysb.data.image_size import resized
from raysb.data.transforms import normalize
from raysb.training.builders import build_network, resolve_device
from raysb.training.outputs import BEST_MODEL_FILE, MODEL_INFO_FILE
from raysb.training.saved_model import ModelInfo

__all__ = ["TrainedModel", "load_model"]


class ModelNotFoundError(ConfigError, FileNotFoundError):
    """A run folder without the files inference needs."""


class TrainedModel(nn.Module):
    """A run's network with its preprocessing, in eval mode. Called on uint8 images (N, C, H, W), as
    raysb's loaders and image decoders give them, it resizes them where the run did (image_size),
    normalises them with the training split's mean and std, and returns the network's logits
    (N, num_classes). `info` says what the run trained: the model, its options, the class count, the
    image shape, the image_size and the statistics."""

    def __init__(self, network: nn.Module, info: ModelInfo):
        super().__init__()
        self.network, self.info = network, info
        self.register_buffer("mean", torch.tensor(info.mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(info.std).view(1, -1, 1, 1), persistent=False)
        self.eval()

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images as the network takes them: resized as the run's were, normalised, on its device."""
        trained = self.info.image_shape
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"expected uint8 images (N, C, H, W), got {images.dtype} {tuple(images.shape)}; "
                             "a model from load_model takes pixels 0..255 and normalises them itself")
        images = resized(images, self.info.image_size)
        if images.shape[1] != trained[0]:
            raise ValueError(f"images have {images.shape[1]} channel(s), but the run trained on {trained[0]} "
                             f"({trained} as C, H, W); convert them ({'to grayscale' if trained[0] == 1 else 'to RGB'}"
                             f", e.g. Pillow's Image.convert) before predicting")
        if tuple(images.shape[1:]) != trained:
            raise ValueError(f"images are {tuple(images.shape[1:])} (C, H, W), but the run trained on {trained}; "
                             "resize them to it (a run trained with image_size resizes them itself)")
        return normalize(images.to(self.mean.device), self.mean, self.std)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.network(self.preprocess(images))

    @torch.inference_mode()
    def probabilities(self, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """Each image's class probabilities (N, num_classes), on the CPU, `batch_size` images at a time."""
        return torch.cat([self(batch).float().softmax(1).cpu() for batch in images.split(batch_size)])


def load_model(run_dir: str | Path, weights: str = BEST_MODEL_FILE, device: str = "cpu") -> TrainedModel:
    """The network a raysb run trained, ready to use on `device` (auto: CUDA where there is one):
    `weights` best_model.pt (the epoch of the lowest test error, the default) or model.pt (the last
    epoch's, written where the run recorded its analysis). A user's own package.module:factory must
    import here as it did in training."""
    run = Path(run_dir)
    info_file, weights_file = run / MODEL_INFO_FILE, run / weights
    for needed in (info_file, weights_file):
        if not needed.is_file():
            raise ModelNotFoundError(f"{run} holds no {needed.name}: give the --out folder of a raysb run that "
                                     "evaluated at least one epoch (runs made before raysb wrote model.json "
                                     "have none)")
    info = ModelInfo.read(info_file)
    try:
        network = build_network(info.model, info.model_options, info.num_classes, info.image_shape)
    except ConfigError as error:  # its model or model_options: named where they were read
        raise ConfigError(f"{info_file}: {error}") from None
    try:
        weights = torch.load(weights_file, map_location="cpu", weights_only=True)
    except Exception as error:  # torch's unpickler raises KeyError, EOFError, RuntimeError... for a file not its own
        raise ConfigError(f"{weights_file} cannot be read as a network's weights ({type(error).__name__}): it is "
                          "cut short, damaged or not a raysb run's weights; put back a copy of it") from None
    try:
        network.load_state_dict(weights)
    except RuntimeError as error:
        # The first of torch's lines names the first layer that differs; a list of missing keys is cut to its head.
        mismatch = next((line.strip() for line in str(error).splitlines() if "size mismatch" in line or "Missing" in line
                         or "Unexpected" in line), str(error).splitlines()[0])
        raise ConfigError(f"{weights_file} does not fit the network {info_file} describes (model {info.model!r}, "
                          f"options {info.model_options}, {info.num_classes} classes, images {list(info.image_shape)}): "
                          f"{textwrap.shorten(mismatch, 250, placeholder=' ...')}") from None
    return TrainedModel(network, info).to(resolve_device(device))
