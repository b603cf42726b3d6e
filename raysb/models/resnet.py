"""ResNet-18 in its CIFAR form (He et al., 2016; as in kuangliu/pytorch-cifar).

The ImageNet stem (7x7 stride-2 conv + max-pool) would shrink a 32x32 image to 8x8
before the first residual stage, so the CIFAR form uses a single 3x3 stride-1 conv.
"""

import torch
from torch import nn
from torch.nn import functional as F

from .weight_init import he_init_


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        # Projection shortcut (option B of the paper) only where the shape changes.
        self.shortcut = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes: int, in_channels: int):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
        )
        stages = []
        in_planes = 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)]
            in_planes = planes
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)
        he_init_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.stages(self.stem(x)))
        return self.fc(torch.flatten(x, 1))
