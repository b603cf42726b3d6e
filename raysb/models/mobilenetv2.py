"""MobileNetV2 (Sandler et al., 2018) in its CIFAR form.

As in kuangliu/pytorch-cifar, the stem and the second stage use stride 1 instead
of 2, so a 32x32 input is downsampled 8x (to 4x4) rather than 32x. The blocks follow
the paper: no expansion conv when t = 1, ReLU6, and a residual only where input
and output shapes match.
"""

import torch
from torch import nn

from .weight_init import he_init_

# (expansion t, output channels c, blocks n, first-block stride s), the paper's Table 2
# with CIFAR strides.
_STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _round_channels(channels: float, divisor: int = 8) -> int:
    # Multiples of 8 map well onto vectorised kernels; never round down by more than
    # 10%, so small width multipliers do not starve a layer.
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * channels else rounded


def _conv_bn_relu6(
    in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1
) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding=kernel_size // 2,
            groups=groups,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int):
        super().__init__()
        hidden = in_channels * expansion
        layers = [] if expansion == 1 else [_conv_bn_relu6(in_channels, hidden, 1)]
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),  # depthwise
            # Linear bottleneck: a ReLU here would destroy information in the
            # low-dimensional projection (the paper's central argument).
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.block = nn.Sequential(*layers)
        self.use_residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.use_residual else out


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int, in_channels: int, *, width_mult: float = 1.0):
        super().__init__()
        if width_mult <= 0:
            raise ValueError(f"mobilenetv2: width_mult must be > 0, got {width_mult}")
        channels = _round_channels(32 * width_mult)
        # The paper keeps the last layer at 1280 channels for width_mult < 1 because
        # shrinking it hurts accuracy far more than it saves compute.
        last_channels = _round_channels(1280 * max(1.0, width_mult))

        layers = [_conv_bn_relu6(in_channels, channels, 3)]
        for expansion, out_channels, blocks, stride in _STAGES:
            out_channels = _round_channels(out_channels * width_mult)
            for i in range(blocks):
                block_stride = stride if i == 0 else 1
                layers.append(InvertedResidual(channels, out_channels, block_stride, expansion))
                channels = out_channels
        layers.append(_conv_bn_relu6(channels, last_channels, 1))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(last_channels, num_classes)
        he_init_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))
