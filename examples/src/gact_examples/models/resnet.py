"""A small ResNet-style CNN (BasicBlocks with BatchNorm) for 8x8 to 32x32 images."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BasicBlock", "ResNetSmall"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a (projected when needed) shortcut.

    Args:
        in_ch: input channels.
        out_ch: output channels.
        stride: stride of the first convolution (and of the shortcut's projection).
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetSmall(nn.Module):
    """Stem convolution, three stages of BasicBlocks, global average pooling, a linear head.

    Args:
        in_channels: image channels (1 for MNIST and digits, 3 for CIFAR-10).
        num_classes: classifier outputs.
        width: channels of the first stage; the stages have ``width``, ``2 width``, ``4 width``
            channels and strides 1, 2, 2.
        blocks: BasicBlocks per stage.

    Example:
        >>> model = ResNetSmall(in_channels=3, num_classes=10, width=8, blocks=2)
        >>> model(torch.randn(4, 3, 32, 32)).shape
        torch.Size([4, 10])
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, width: int = 16, blocks: int = 1
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers, ch = [], width
        for i, mult in enumerate((1, 2, 4)):
            for b in range(blocks):
                stride = 2 if (i > 0 and b == 0) else 1
                layers.append(BasicBlock(ch, width * mult, stride))
                ch = width * mult
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
