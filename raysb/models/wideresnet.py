"""Wide ResNet WRN-depth-k (Zagoruyko & Komodakis, 2016), as in DeVries & Taylor's
Cutout code: pre-activation basic blocks, dropout between the two convs, and 1x1
convs (without BatchNorm) on the shortcuts that change shape.
"""

import torch
from torch import nn
from torch.nn import functional as F

from .weight_init import he_init_


class WideBasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int, dropout: float):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.shortcut = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.bn1(x))
        out = self.conv1(pre)
        out = self.conv2(self.dropout(F.relu(self.bn2(out))))
        # A projecting shortcut reads the pre-activated input (as in the reference
        # code); an identity shortcut carries the raw input, keeping the residual
        # path free of nonlinearities.
        residual = x if self.shortcut is None else self.shortcut(pre)
        return out + residual


class WideResNet(nn.Module):
    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        *,
        depth: int = 28,
        widen_factor: int = 10,
        dropout: float = 0.0,
    ):
        super().__init__()
        # The paper counts layers so that n blocks (two 3x3 convs each) in each of
        # the 3 stages give depth = 6n + 4.
        if depth < 10 or (depth - 4) % 6 != 0:
            raise ValueError(
                f"wideresnet: depth must be 6n+4 with n >= 1 (10, 16, ..., 28), got {depth}"
            )
        if widen_factor < 1:
            raise ValueError(f"wideresnet: widen_factor must be >= 1, got {widen_factor}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"wideresnet: dropout must be in [0, 1), got {dropout}")
        blocks_per_stage = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]

        self.stem = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        stages = []
        for in_planes, planes, stride in zip(widths[:-1], widths[1:], (1, 2, 2)):
            stages.append(WideBasicBlock(in_planes, planes, stride, dropout))
            stages += [
                WideBasicBlock(planes, planes, 1, dropout) for _ in range(blocks_per_stage - 1)
            ]
        self.stages = nn.Sequential(*stages)
        # Pre-activation blocks end on a conv, so the network applies the last BN-ReLU.
        self.head = nn.Sequential(
            nn.BatchNorm2d(widths[-1]),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(widths[-1], num_classes),
        )
        he_init_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))
