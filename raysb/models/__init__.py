"""Image classifiers by name.

Every model takes any number of input channels and any input size from 4x4 up (it
ends in adaptive average pooling), and returns logits of shape (N, num_classes).
Architecture-specific options are keyword arguments of `build_model`, e.g.
``build_model("wideresnet", 10, depth=16, widen_factor=8)`` for WRN-16-8.

A user's own network is named ``package.module:factory``: the factory is called as
``factory(num_classes, in_channels, **model_options)``, with ``image_size=`` too
where it takes that keyword, and returns the ``nn.Module``.
"""

import inspect

import torch
from torch import nn

from raysb.core.imports import import_named

from .densenet import DenseNet
from .mobilenetv2 import MobileNetV2
from .resnet import ResNet18
from .small_cnn import SmallCNN
from .wideresnet import WideResNet

__all__ = ["MODEL_NAMES", "build_model", "check_outputs"]

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
    """The callable `package.module:factory` names (raysb.core.imports finds its module)."""
    if name in _HANDED_OVER:
        return _HANDED_OVER[name]
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"model {name!r}: name your own model as package.module:factory")
    factory = getattr(import_named(module_name, f"model {name!r}"), attribute, None)
    if not callable(factory):
        raise ValueError(f"model {name!r}: {module_name} has no callable {attribute}")
    return factory


def _user_model(name: str, num_classes: int, in_channels: int, image_size: int, options: dict) -> nn.Module:
    factory = user_factory(name)
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if "image_size" in parameters or takes_any:
        options = {"image_size": image_size, **options}
    call = f"{inspect.unwrap(factory).__name__}(num_classes, in_channels, **model_options)"
    try:
        model = factory(num_classes, in_channels, **options)
    except TypeError as error:
        raise ValueError(f"model {name!r}: calling it as {call} failed: {error}") from None
    except Exception as error:  # the user's own code: its error, in one line, is what they need
        raise ValueError(f"model {name!r}: {call} raised {type(error).__name__}: {error}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise ValueError(f"model {name!r} has no trainable parameters: there is nothing for the optimizer to train")
    return model


def check_outputs(name: str, model: nn.Module, num_classes: int, image_shape: tuple[int, int, int]) -> None:
    """Refuse a model whose logits do not have one column per class, before training starts:
    the loss would otherwise fail at the first batch with a label beyond its outputs
    (`IndexError: Target 9 is out of bounds`) or, with more outputs than classes, train without a word.
    One forward of two blank images, in eval mode (BatchNorm's statistics stay as they are)."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(torch.zeros(2, *image_shape))
    except Exception as error:  # the user's own code, as in _user_model
        raise ValueError(
            f"model {name!r}: a forward of a batch of shape {(2, *image_shape)} raised {type(error).__name__}: {error}"
        ) from None
    finally:
        model.train(training)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (2, num_classes):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"model {name!r} outputs {shape} for a batch of 2 images, but the data has {num_classes} classes: "
            f"it must output (batch, {num_classes}) logits, one per class (num_classes, its factory's first argument)"
        )
