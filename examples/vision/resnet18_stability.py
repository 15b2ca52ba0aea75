"""Does compression make training less stable? torchvision's ResNet-18 on CIFAR-10, near the
edge of fp32's stable learning rates.

The architecture is torchvision's ``resnet18(num_classes=10)`` rebuilt in plain torch (the CPU
torch these examples run on cannot import torchvision): 7x7 stride-2 stem, 3x3 stride-2 max-pool,
four stages of two BasicBlocks with ``ReLU(inplace=True)``. Trained on ``--images``
CIFAR-10 training images (a fixed random subset, 32x32), SGD with momentum 0.9, for every
learning rate, seed and level; the record of each run says whether and when the loss became NaN,
its final loss (mean of the last ``--tail`` steps) and its largest gradient norm. With
``--variance-steps``, the L1 runs also measure, at those steps and per parameter, the variance
that rounding adds to the gradient over the minibatch variance (the premise of GACT's analysis:
it should be small). ``--layout memory`` groups in memory order, as the original GACT did.

    python examples/vision/resnet18_stability.py --data DATA --lrs 0.05,0.1 --seeds 0,1,2 \
        --levels L0,L1,L2,L1.2,L2.2 --steps 300 --variance-steps 0,100,200,299
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
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


def _batches(images: torch.Tensor, labels: torch.Tensor, size: int, gen: torch.Generator):
    while True:
        idx = torch.randint(0, len(images), (size,), generator=gen)
        yield images[idx], labels[idx]


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _spread(samples: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Per parameter, the summed variance of the samples (unbiased)."""
    out = {}
    for name in samples[0]:
        stack = torch.stack([s[name] for s in samples]).double()
        out[name] = float(stack.var(0, unbiased=True).sum())
    return out


def variance_ratios(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, config: GactConfig,
    args: argparse.Namespace, seed: int,
) -> dict[str, float]:  # fmt: skip
    """Per parameter, the quantization variance of the gradient at ``config`` (over
    ``--variance-draws`` rounding seeds on one batch) over the minibatch variance (fp32, over as
    many batches of the same size), both at the model's current weights, in train mode."""
    probe = copy.deepcopy(model)  # BatchNorm's running statistics move on the copy only
    probe.train()
    gen = torch.Generator().manual_seed(10_000 + seed)
    batches = _batches(images, labels, args.batch_size, gen)
    minibatch = _spread([_grads(probe, *next(batches)) for _ in range(args.variance_draws)])
    x, y = next(batches)
    draws = []
    for r in range(args.variance_draws):
        with Controller(probe, config.replace(seed=1000 * seed + r)):
            draws.append(_grads(probe, x, y))
    rounding = _spread(draws)
    return {n: rounding[n] / max(minibatch[n], 1e-30) for n in minibatch}


def train(images: torch.Tensor, labels: torch.Tensor, level: str, seed: int, lr: float,
          args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(seed)
    model = ResNet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    batches = _batches(images, labels, args.batch_size, torch.Generator().manual_seed(seed))
    config = GactConfig.from_level(level, seed=seed, channel_groups=args.layout == "channel")
    controller = Controller(model, config)
    probe_at = {int(s) for s in args.variance_steps.split(",") if s} if level == "L1" else set()
    losses: list[float] = []
    grad_norms: list[float] = []
    ratios: dict[int, dict[str, float]] = {}
    first_nan = None
    with controller:
        for step in range(args.steps):
            x, y = next(batches)
            if step in probe_at:
                with controller.paused():
                    ratios[step] = variance_ratios(model, images, labels, config, args, seed)

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                model.train()
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                return loss

            loss = float(controller.iterate(closure).detach())
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grad_norms.append(
                float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            )
            optimizer.step()
            losses.append(loss)
            if not math.isfinite(loss):
                first_nan = step
                break
    tail = losses[-args.tail :]
    return {
        "level": level,
        "seed": seed,
        "lr": lr,
        "layout": args.layout,
        "steps": args.steps,
        "first_nan_step": first_nan,
        "final_loss": statistics.fmean(tail) if first_nan is None else math.nan,
        "max_grad_norm": max(grad_norms),
        "losses": losses,
        "grad_norms": grad_norms,
        "variance_ratios": ratios,
        "ratio": controller.stats()["ratio"],
    }


def load_subset(data: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` CIFAR-10 training images (a fixed random subset: the archive is class-sorted),
    normalised, NCHW."""
    cifar = load_cifar10(data)
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    pick = torch.randperm(len(cifar["y_train"]), generator=torch.Generator().manual_seed(0))
    pick = pick[:count].numpy()
    images = torch.from_numpy(cifar["x_train"][pick]).float().div(255).permute(0, 3, 1, 2)
    return (images - mean) / std, torch.from_numpy(cifar["y_train"][pick]).long()


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--levels", default="L0,L1,L2,L1.2,L2.2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lrs", default="0.05,0.1", help="SGD learning rates (momentum 0.9)")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--tail", type=int, default=20, help="final loss: mean of the last N steps")
    p.add_argument(
        "--layout", choices=("channel", "memory"), default="channel",
        help="GactConfig.channel_groups on (channel) or off (memory order, the original's)",
    )  # fmt: skip
    p.add_argument(
        "--variance-steps", default="",
        help="steps at which L1 runs measure quantization / minibatch variance per parameter",
    )  # fmt: skip
    p.add_argument("--variance-draws", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="resnet18_stability.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    images, labels = load_subset(args.data, args.images)
    records = []
    for lr in (float(v) for v in args.lrs.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            for level in args.levels.split(","):
                rec = train(images, labels, level, seed, lr, args)
                records.append(rec)
                Path(args.out).write_text(json.dumps(records))
                print(f"lr {lr} seed {seed} {level}: first NaN at {rec['first_nan_step']}, "
                      f"final loss {rec['final_loss']:.3f}, max grad norm "
                      f"{rec['max_grad_norm']:.1f}", flush=True)  # fmt: skip
    return records


if __name__ == "__main__":
    main()
