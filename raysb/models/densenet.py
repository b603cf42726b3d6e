"""DenseNet-BC for CIFAR (Huang et al., 2017): three dense blocks of bottleneck
layers joined by compressing transitions; DenseNet-BC-100-12 has ~0.77M parameters.
"""

import torch
from torch import nn
from torch.nn import functional as F

from .weight_init import he_init_


class Bottleneck(nn.Module):
    """BN-ReLU-conv1x1(4k)-BN-ReLU-conv3x3(k), concatenated onto its input."""

    def __init__(self, in_channels: int, growth_rate: int):
        super().__init__()
        # The 1x1 conv caps the 3x3 conv's input at 4k channels, however wide the
        # concatenated input has grown; this is the "B" in DenseNet-BC.
        inner = 4 * growth_rate
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, inner, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(inner)
        self.conv2 = nn.Conv2d(inner, growth_rate, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return torch.cat([x, out], dim=1)


class Transition(nn.Sequential):
    """BN-ReLU-conv1x1 compressing the channels, then 2x2 average pooling."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(
            nn.BatchNorm2d(in_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(in_channels, out_channels, 1, bias=False),
            nn.AvgPool2d(2),
        )


class DenseNet(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        *,
        depth: int = 100,
        growth_rate: int = 12,
        reduction: float = 0.5,
    ):
        super().__init__()
        # depth counts the stem, the classifier, the 2 transitions and two convs per
        # bottleneck layer: depth = 3 * 2n + 4 for n layers per dense block.
        if depth < 10 or (depth - 4) % 6 != 0:
            raise ValueError(
                f"densenet: depth must be 6n+4 with n >= 1 (10, 16, ..., 100), got {depth}"
            )
        if growth_rate < 1:
            raise ValueError(f"densenet: growth_rate must be >= 1, got {growth_rate}")
        if not 0.0 < reduction <= 1.0:
            raise ValueError(f"densenet: reduction must be in (0, 1], got {reduction}")
        layers_per_block = (depth - 4) // 6

        channels = 2 * growth_rate
        layers = [nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)]
        for block in range(3):
            for _ in range(layers_per_block):
                layers.append(Bottleneck(channels, growth_rate))
                channels += growth_rate
            if block < 2:
                compressed = int(channels * reduction)
                layers.append(Transition(channels, compressed))
                channels = compressed
        # Bottlenecks end on a conv, so the last BN-ReLU is applied here.
        layers += [nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)
        he_init_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))
