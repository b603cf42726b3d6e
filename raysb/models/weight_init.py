"""Weight initialisation shared by the deep CIFAR architectures."""

from torch import nn


def he_init_(model: nn.Module) -> nn.Module:
    """He-normal convs, unit-scale BatchNorm, zero biases (in place).

    PyTorch's default conv init is scaled for leaky-ReLU slope sqrt(5) and shrinks
    activations layer by layer; He init keeps their variance stable through deep
    ReLU stacks, which is what the reference ResNet/WRN/DenseNet/MobileNetV2
    implementations use and what their published accuracies were obtained with.
    """
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
    return model
