"""What inference needs beside a run's weights, written where they are: model.json names the network
(raysb's, or a user's package.module:factory) and its options, the class count, the image shape the
network takes, the image_size every image was resized to and the training split's normalisation
statistics, so that `raysb.load_model(run_dir)` rebuilds the network and its preprocessing from the
run folder alone."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from raysb.training.outputs import BEST_MODEL_FILE, MODEL_INFO_FILE, save_atomically, write_json


@dataclass(frozen=True)
class ModelInfo:
    """A trained network as inference rebuilds it."""

    model: str
    model_options: dict[str, Any]
    num_classes: int
    # (C, H, W): what the network takes, once resized
    image_shape: tuple[int, int, int]
    # every image resized to image_size x image_size before it is normalised; None: taken as it is
    image_size: int | None
    # per channel, of the training split's pixels / 255
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> ModelInfo:
        return cls(**{**values, "image_shape": tuple(values["image_shape"]), "mean": tuple(values["mean"]),
                      "std": tuple(values["std"])})


def save_best_model(model: nn.Module, shard, record: dict[str, Any], out: Path) -> None:
    """The weights of the best epoch so far, with model.json beside them: what the run's `record` (its
    config) and its training `shard` say of the network and its inputs. Each file is written whole."""
    save_atomically(model.state_dict(), out / BEST_MODEL_FILE)
    info = ModelInfo(
        model=record["model"],
        model_options=dict(record["model_options"]),
        num_classes=shard.num_classes,
        image_shape=tuple(shard.image_shape),
        image_size=record["image_size"],
        mean=tuple(shard.mean),
        std=tuple(shard.std),
    )
    write_json(out / MODEL_INFO_FILE, asdict(info))
