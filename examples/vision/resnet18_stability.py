"""Does compression make training less stable? torchvision's ResNet-18 on CIFAR-10, near the
edge of fp32's stable learning rates.

The architecture is torchvision's ``resnet18(num_classes=10)`` rebuilt in plain torch (the CPU
torch these examples run on cannot import torchvision): 7x7 stride-2 stem, 3x3 stride-2 max-pool,
four stages of two BasicBlocks with ``ReLU(inplace=True)``. Trained on ``--images``
CIFAR-10 training images (a fixed random subset, 32x32), SGD with momentum, for every level and seed; the record of
each run says whether and when the loss became NaN.

    python examples/vision/resnet18_stability.py --data DATA --levels L0,L1,L2,L2.2 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gact import Controller, GactConfig
from gact_examples.data import load_cifar10
from torch import nn


class Block(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layout (stem, max-pool, [2, 2, 2, 2] BasicBlocks)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths, stages, in_ch = (64, 128, 256, 512), [], 64
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(Block(in_ch, width, stride), Block(width, width, 1)))
            in_ch = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def train(images: torch.Tensor, labels: torch.Tensor, level: str, seed: int,
          args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(seed)
    model = ResNet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    controller = Controller(model, GactConfig.from_level(level, seed=seed))
    losses: list[float] = []
    first_nan = None
    with controller:
        for step in range(args.steps):
            idx = torch.randint(0, len(images), (args.batch_size,), generator=gen)
            x, y = images[idx], labels[idx]

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                model.train()
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                return loss

            loss = float(controller.iterate(closure))
            optimizer.step()
            losses.append(loss)
            if not math.isfinite(loss):
                first_nan = step
                break
    return {
        "level": level,
        "seed": seed,
        "first_nan_step": first_nan,
        "losses": losses,
        "ratio": controller.stats()["ratio"],
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--levels", default="L0,L1,L2,L2.2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--steps", type=int, default=93, help="93 steps of 64 = 3 epochs of 2,000")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", default="resnet18_stability.json")
    args = p.parse_args(argv)
    data = load_cifar10(args.data)
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    # the archive is class-sorted: a fixed random subset of all classes
    pick = torch.randperm(len(data["y_train"]), generator=torch.Generator().manual_seed(0))
    pick = pick[: args.images].numpy()
    images = torch.from_numpy(data["x_train"][pick]).float().div(255).permute(0, 3, 1, 2)
    images = (images - mean) / std
    labels = torch.from_numpy(data["y_train"][pick]).long()
    records = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for level in args.levels.split(","):
            rec = train(images, labels, level, seed, args)
            records.append(rec)
            Path(args.out).write_text(json.dumps(records))
            print(f"seed {seed} {level}: first NaN at {rec['first_nan_step']}, "
                  f"last loss {rec['losses'][-1]:.3f}")  # fmt: skip
    return records


if __name__ == "__main__":
    main()
