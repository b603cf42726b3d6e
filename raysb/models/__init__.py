"""Image classifiers by name.

Every model takes any number of input channels and any input size from 4x4 up (it
ends in adaptive average pooling), and returns logits of shape (N, num_classes).
Architecture-specific options are keyword arguments of `build_model`, e.g.
``build_model("wideresnet", 10, depth=16, widen_factor=8)`` for WRN-16-8.

A user's own network is named ``package.module:factory``: the factory is called as
``factory(num_classes, in_channels, **model_options)``, with ``image_size=`` too
where it takes that keyword, and returns the ``nn.Module``.
"""

import importlib
import inspect
import os
import sys

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
    if name not in _MODELS and ":" not in name:
        raise ValueError(
            f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}, or your own as package.module:factory"
        )
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")

    if name not in _MODELS:
        return _user_model(name, num_classes, in_channels, image_size, options)
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


# Factories handed over already resolved: a Ray Train worker gets its driver's by value
# (raysb.distributed.launch), since the driver's folder is not on the worker's path.
_HANDED_OVER: dict = {}


def hand_over_factory(name: str, factory) -> None:
    """Build `name` with `factory` from now on in this process, without importing it."""
    _HANDED_OVER[name] = factory


def user_factory(name: str):
    """The callable `package.module:factory` names, importable from the working directory as
    `python -m` would find it (raysb's console script alone would not look there)."""
    if name in _HANDED_OVER:
        return _HANDED_OVER[name]
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"model {name!r}: name your own model as package.module:factory")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"model {name!r}: cannot import {module_name} ({error}); install it, or run from the folder that "
            "holds it (on a Ray cluster: ray job submit --working-dir that folder)"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"model {name!r}: {module_name} has no callable {attribute}")
    return factory


def _user_model(name: str, num_classes: int, in_channels: int, image_size: int, options: dict) -> nn.Module:
    factory = user_factory(name)
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if "image_size" in parameters or takes_any:
        options = {"image_size": image_size, **options}
    try:
        model = factory(num_classes, in_channels, **options)
    except TypeError as error:
        raise ValueError(
            f"model {name!r}: calling it as {inspect.unwrap(factory).__name__}(num_classes, in_channels, "
            f"**model_options) failed: {error}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
