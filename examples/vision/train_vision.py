"""Image classification with a small ResNet-style CNN on MNIST, CIFAR-10 (JPEG archive) or the
scikit-learn digits.

    python examples/vision/train_vision.py --data DATA --dataset mnist
    python examples/vision/train_vision.py --data DATA --dataset cifar10 --gact --level L2
    python examples/vision/train_vision.py --dataset digits --gact --level L2.2   # no files needed

DATA is the folder holding ``mnist/`` (four idx ``.gz`` files) and ``cifar10-jpg/``
(``cifar10_jpg.tar.gz``), or the dataset's own folder.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gact_examples.data import load_cifar10, load_digits_split, load_mnist
from gact_examples.models import ResNetSmall
from gact_examples.train import (
    Run,
    base_parser,
    check_args,
    finish,
    progress,
    setup,
    sub_batch_probe,
)

# per-channel mean/std of the training images (0..1 scale)
NORM = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4913, 0.4821, 0.4465), (0.2452, 0.2428, 0.2606)),
    "digits": ((0.305,), (0.375,)),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0], epochs=1, batch_size=128)
    p.add_argument("--dataset", choices=sorted(NORM), default="mnist")
    p.add_argument("--train-subset", type=int, default=None, help="use the first N train images")
    p.add_argument("--test-subset", type=int, default=None, help="evaluate on N test images")
    p.add_argument("--width", type=int, default=16, help="channels of the first stage")
    p.add_argument("--blocks", type=int, default=1, help="BasicBlocks per stage")
    p.add_argument("--image-size", type=int, default=None, help="resize images (e.g. digits)")
    p.add_argument("--cache-dir", default=None, help="decoded CIFAR-10 cache (~/.cache default)")
    p.add_argument("--no-augment", action="store_true", help="no random flips/crops on CIFAR")
    args = p.parse_args(argv)
    check_args(p, args, needs_data=args.dataset != "digits")
    return args


def load(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """uint8 NCHW image tensors and int64 labels (``x_train``, ``y_train``, ``x_test``, ...)."""
    if args.dataset == "mnist":
        d = load_mnist(args.data)
    elif args.dataset == "cifar10":
        d = load_cifar10(args.data, args.cache_dir)
    else:
        d = load_digits_split(seed=0)
    out = {}
    for split in ("train", "test"):
        x, y = d[f"x_{split}"], d[f"y_{split}"]
        n = args.train_subset if split == "train" else args.test_subset
        if n is not None:
            # a class-balanced subset: a fixed permutation (CIFAR is stored sorted by class)
            perm = np.random.default_rng(1234).permutation(len(x))[:n]
            x, y = x[np.sort(perm)], y[np.sort(perm)]
        x = torch.from_numpy(np.ascontiguousarray(x))
        x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2).contiguous()
        out[f"x_{split}"], out[f"y_{split}"] = x, torch.from_numpy(y)
    return out


class Preprocess:
    """uint8 batch -> normalised float batch on the device (optionally resized / augmented)."""

    def __init__(self, dataset: str, device: torch.device, size: int | None, augment: bool) -> None:
        mean, std = NORM[dataset]
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.device, self.size, self.augment = device, size, augment

    def __call__(self, x: torch.Tensor, train: bool) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True).float().div_(255)
        if self.size is not None and self.size != x.shape[-1]:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        x = (x - self.mean) / self.std
        if train and self.augment:  # random horizontal flip + random 4-pixel translation
            flip = torch.rand(x.shape[0], device=x.device) < 0.5
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
            dx, dy = (int(v) for v in torch.randint(-4, 5, (2,)))
            x = torch.roll(F.pad(x, (4, 4, 4, 4)), shifts=(dy, dx), dims=(2, 3))[..., 4:-4, 4:-4]
        return x


@torch.no_grad()
def evaluate(
    model: ResNetSmall, pre: Preprocess, x: torch.Tensor, y: torch.Tensor, batch: int = 1000
) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        out = model(pre(x[i : i + batch], train=False))
        correct += int((out.argmax(1).cpu() == y[i : i + batch]).sum())
    return correct / max(1, len(x))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = setup(args)
    data = load(args)
    in_ch = data["x_train"].shape[1]
    model = ResNetSmall(in_ch, 10, args.width, args.blocks).to(device)
    pre = Preprocess(
        args.dataset,
        device,
        args.image_size,
        augment=args.dataset == "cifar10" and not args.no_augment,
    )
    lr = args.lr or 0.05
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    n_train = len(data["x_train"])
    steps_per_epoch = math.ceil(n_train / args.batch_size)
    total = args.mem_steps if args.get_mem else args.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, lr, total_steps=max(total, 2), pct_start=0.15
    )
    gen = torch.Generator().manual_seed(args.seed)

    xb = yb = None

    def closure(rows: int | None = None) -> torch.Tensor:
        model.train()
        loss = F.cross_entropy(model(xb[:rows]), yb[:rows])
        optimizer.zero_grad()
        loss.backward()
        return loss

    with Run(args, model, device) as run:
        bar = progress(range(total), args, desc=f"{args.dataset} {run.level}")
        batches = iter(())
        for step in bar:
            idx = next(batches, None)
            if idx is None:
                batches = iter(torch.randperm(n_train, generator=gen).split(args.batch_size))
                idx = next(batches)
            if args.get_mem:  # memory runs: always full batches
                idx = torch.arange(step * args.batch_size, (step + 1) * args.batch_size) % n_train
            xb = pre(data["x_train"][idx], train=True)
            yb = data["y_train"][idx].to(device)
            loss = run.step(closure, sub_batch_probe(args, len(yb), closure))
            optimizer.step()
            sched.step()
            if (step + 1) % 10 == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}")
            if not args.get_mem and (step + 1) % steps_per_epoch == 0:
                run.log_epoch(epoch=(step + 1) // steps_per_epoch, loss=float(loss))

    acc = None if args.get_mem else evaluate(model, pre, data["x_test"], data["y_test"])
    rec = run.result(
        model=f"resnet-small-w{args.width}b{args.blocks}",
        dataset=args.dataset,
        metric="test_accuracy",
        final_metric=acc,
        item_unit="images",
        items_per_step=args.batch_size,
        batch_size=args.batch_size,
        train_images=n_train,
        test_images=len(data["x_test"]),
        image_size=args.image_size or int(data["x_train"].shape[-1]),
        lr=lr,
    )
    return finish(args, run, rec)


if __name__ == "__main__":
    main()
