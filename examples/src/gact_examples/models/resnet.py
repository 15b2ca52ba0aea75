"""ResNet-style CNNs (BasicBlocks with BatchNorm): a small one for 8x8 to 32x32 images, and
torchvision's ResNet-18 layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BasicBlock", "ResNet18", "ResNetSmall"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a (projected when needed) shortcut.

    Args:
        in_ch: input channels.
        out_ch: output channels.
        stride: stride of the first convolution (and of the shortcut's projection).
        inplace: ReLUs in place, as torchvision's.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace
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
        out = F.relu(self.bn1(self.conv1(x)), inplace=self.inplace)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x), inplace=self.inplace)


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


class ResNet18(nn.Module):
    """torchvision's ``resnet18(num_classes=...)`` layout, in plain torch (the CPU torch these
    examples run on cannot import torchvision): 7x7 stride-2 stem, 3x3 stride-2 max-pool, four
    stages of two BasicBlocks (64, 128, 256, 512 channels) with ReLUs in place, Kaiming
    initialisation. On 32x32 images its stages see 8x8, 4x4, 2x2 and 1x1 maps.

    Example:
        >>> ResNet18(num_classes=10)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, in_ch = [], 64
        for i, width in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            stages.append(
                nn.Sequential(
                    BasicBlock(in_ch, width, stride, inplace=True),
                    BasicBlock(width, width, 1, inplace=True),
                )
            )
            in_ch = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x)), inplace=True))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
