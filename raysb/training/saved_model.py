"""What inference needs beside a run's weights, written where they are: model.json names the network
(raysb's, or a user's package.module:factory) and its options, the class count, the image shape the
network takes, the image_size every image was resized to and the training split's normalisation
statistics, so that `raysb.load_model(run_dir)` rebuilds the network and its preprocessing from the
run folder alone."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from raysb.core.errors import ConfigError

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

    @classmethod
    def read(cls, path: Path) -> ModelInfo:
        """model.json at `path`, every field checked: a file edited by hand gets one line naming the file
        and the field, never a traceback from the network or NaN probabilities."""
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON ({error.msg}, line {error.lineno} column {error.colno})") from None
        except UnicodeDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON (not UTF-8 text: byte {error.start})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a JSON object with the fields {', '.join(cls.__annotations__)}")
        missing = [name for name in cls.__annotations__ if name not in values]
        unknown = sorted(set(values) - set(cls.__annotations__))
        if missing or unknown:
            raise ConfigError(f"{path}: " + "; ".join(
                [*([f"missing {', '.join(missing)}"] if missing else []),
                 *([f"unknown field {', '.join(unknown)}"] if unknown else [])]))
        for problem in _problems(values):
            raise ConfigError(f"{path}: {problem}")
        return cls.from_json(values)


def _problems(values: dict[str, Any]):
    """What is wrong with model.json's `values`, field by field."""
    def whole(value, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    def numbers(value) -> bool:
        return isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               and math.isfinite(v) for v in value)

    if not isinstance(values["model"], str) or not values["model"]:
        yield f"model must name a network, got {values['model']!r}"
    if not isinstance(values["model_options"], dict):
        yield f"model_options must be an object, got {values['model_options']!r}"
    if not whole(values["num_classes"], 2):
        yield f"num_classes must be a whole number >= 2, got {values['num_classes']!r}"
    shape = values["image_shape"]
    if not (isinstance(shape, list) and len(shape) == 3 and all(whole(side, 1) for side in shape)):
        yield f"image_shape must be [channels, height, width], three whole numbers >= 1, got {shape!r}"
        return
    size = values["image_size"]
    if size is not None and not whole(size, 1):
        yield f"image_size must be a whole number >= 1 or null, got {size!r}"
    elif size is not None and shape[1:] != [size, size]:
        # Otherwise predict resizes to image_size and then refuses what it made, telling the user to resize.
        yield (f"image_size {size} does not match image_shape {shape}: a run with image_size N trains on N x N "
               "images")
    for name in ("mean", "std"):
        if not numbers(values[name]) or len(values[name]) != shape[0]:
            yield f"{name} must hold one finite number a channel ({shape[0]}, as image_shape says), got {values[name]!r}"
    if numbers(values["std"]) and not all(v > 0 for v in values["std"]):
        yield f"std must be > 0 in every channel (images are divided by it), got {values['std']!r}"


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
