"""A small, fast CNN: the default model, sized for Fashion-MNIST on a few CPU cores."""

import torch
from torch import nn


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    # The conv has no bias because the BatchNorm right after it has its own shift.
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class SmallCNN(nn.Module):
    """conv(w)-BN-ReLU-pool, conv(2w)-BN-ReLU-pool, linear(4w), linear(num_classes)."""

    def __init__(self, num_classes: int, in_channels: int, *, image_size: int, width: int = 32):
        super().__init__()
        if width < 1:
            raise ValueError(f"small-cnn: width must be >= 1, got {width}")
        if image_size < 4:
            raise ValueError(
                f"small-cnn: image_size must be >= 4 (two 2x2 max-pools), got {image_size}"
            )
        self.features = nn.Sequential(
            _conv_block(in_channels, width),
            _conv_block(width, 2 * width),
        )
        # Unlike the deep models, the head keeps the spatial layout: two convs see
        # only a 10x10 patch each, too little to encode in their channels where in
        # the image a feature fired, so global pooling would discard that. The
        # pooled size is the feature-map size at the nominal image_size, so the
        # pool is a no-op there and only resamples inputs of other sizes.
        pooled = image_size // 4
        self.pool = nn.AdaptiveAvgPool2d(pooled)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * pooled * pooled, 4 * width),
            nn.ReLU(inplace=True),
            nn.Linear(4 * width, num_classes),
        )
        # NHWC weights make the convs emit NHWC activations, for which the CPU
        # BatchNorm/ReLU/max-pool kernels vectorise over channels: forward+backward
        # ran about a third faster on 2 CPU cores, with the same results. Flatten
        # still yields features in (C, H, W) order, so checkpoints do not depend on
        # the layout.
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)))
