"""Image classifiers by name.

Every model takes any number of input channels and any input size from 4x4 up (it
ends in adaptive average pooling), and returns logits of shape (N, num_classes).
Architecture-specific options are keyword arguments of `build_model`, e.g.
``build_model("wideresnet", 10, depth=16, widen_factor=8)`` for WRN-16-8.
"""

import inspect

from torch import nn

from .densenet import DenseNet
from .mobilenetv2 import MobileNetV2
from .resnet import ResNet18
from .small_cnn import SmallCNN
from .wideresnet import WideResNet

__all__ = ["MODEL_NAMES", "build_model"]

_MODELS: dict[str, type[nn.Module]] = {
    "small-cnn": SmallCNN,
    "resnet18": ResNet18,
    "wideresnet": WideResNet,
    "mobilenetv2": MobileNetV2,
    "densenet": DenseNet,
}

MODEL_NAMES: tuple[str, ...] = tuple(_MODELS)


def _keyword_parameters(model_cls: type[nn.Module]) -> tuple[str, ...]:
    # A model's options are the keyword-only parameters of its constructor, so the
    # constructor signature is the single place where they are declared.
    parameters = inspect.signature(model_cls).parameters.values()
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def build_model(
    name: str, num_classes: int, in_channels: int = 3, image_size: int = 32, **options
) -> nn.Module:
    """Build the classifier `name` for `num_classes` classes.

    `image_size` is the expected input height/width; only models whose head depends
    on it (small-cnn) use it, and all models still accept other sizes.
    Raises ValueError for an unknown name or option, or an invalid size or option value.
    """
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")

    model_cls = _MODELS[name]
    accepted = _keyword_parameters(model_cls)
    valid_options = [p for p in accepted if p != "image_size"]
    unknown = sorted(set(options) - set(valid_options))
    if unknown:
        valid = ", ".join(valid_options) if valid_options else "none"
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for model {name!r}; valid options: {valid}"
        )
    if "image_size" in accepted:
        options["image_size"] = image_size
    return model_cls(num_classes, in_channels, **options)
