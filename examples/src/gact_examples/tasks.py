"""The stability study's model families, as ``examples/stability.py``,
``examples/rotation_bench.py`` and ``examples/group_layouts.py`` train them: torchvision's ResNet-18 layout on CIFAR-10 (SGD with
momentum 0.9), and the model matrix's ViT (CIFAR-10, 4x4 patches) and LLaMA-style decoder
(tiny-shakespeare characters, 64 per sequence), 2 layers of width 64 from ``transformers``
configs, with AdamW."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .data import load_char_corpus, load_cifar10
from .models import ResNet18

__all__ = ["Batch", "Task", "load_images", "make_task", "warmed_up"]

Batch = tuple[torch.Tensor, torch.Tensor]


class Task(NamedTuple):
    """A model family: how to build it, draw its batches, compute its loss and optimise it."""

    build: Callable[[], nn.Module]
    batches: Callable[[torch.Generator], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    optimizer: Callable[[nn.Module, float], torch.optim.Optimizer]


def _sgd(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def _classify(model: nn.Module, batch: Batch) -> torch.Tensor:
    out = model(batch[0])
    return F.cross_entropy(getattr(out, "logits", out), batch[1])


def _language(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[1]).loss


def _samples(
    inputs: torch.Tensor, targets: torch.Tensor, size: int
) -> Callable[[torch.Generator], Iterator[Batch]]:
    def batches(gen: torch.Generator) -> Iterator[Batch]:
        while True:
            idx = torch.randint(0, len(inputs), (size,), generator=gen)
            yield inputs[idx], targets[idx]

    return batches


def load_images(data: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` CIFAR-10 training images (a fixed random subset: the archive is class-sorted),
    normalised, NCHW."""
    cifar = load_cifar10(data)
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    pick = torch.randperm(len(cifar["y_train"]), generator=torch.Generator().manual_seed(0))
    pick = pick[:count].numpy()
    images = torch.from_numpy(cifar["x_train"][pick]).float().div(255).permute(0, 3, 1, 2)
    return (images - mean) / std, torch.from_numpy(cifar["y_train"][pick]).long()


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=256, num_labels=10,
    )  # fmt: skip
    return ViTForImageClassification(config)


def _llama(vocab: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            attn_implementation="sdpa",
        )  # fmt: skip
        return LlamaForCausalLM(config)

    return build


def make_task(name: str, args: argparse.Namespace) -> Task:
    if name == "llama":
        corpus = load_char_corpus(args.data)
        ids = torch.from_numpy(corpus["train"])
        starts = torch.arange(0, len(ids) - 65, 64)
        windows = ids[starts[:, None] + torch.arange(64)]
        return Task(
            _llama(len(corpus["chars"])), _samples(windows, windows, args.batch_size), _language,
            _adamw,
        )  # fmt: skip
    images, labels = load_images(args.data, args.images)
    if name == "vit":
        return Task(_vit, _samples(images, labels, args.batch_size), _classify, _adamw)
    return Task(ResNet18, _samples(images, labels, args.batch_size), _classify, _sgd)


def warmed_up(
    task: Task, steps: int, device: torch.device | str = "cpu", lr: float = 1e-3
) -> tuple[nn.Module, Iterator[Batch]]:
    """``task``'s model (seed 0) after ``steps`` fp32 training steps with its optimizer at
    ``lr``, and the rest of its batch stream (seed 0), on ``device``: the trained weights the
    diagnosis scripts measure at."""
    device = torch.device(device)
    torch.manual_seed(0)
    model = task.build().to(device)
    batches = (
        (x.to(device), y.to(device)) for x, y in task.batches(torch.Generator().manual_seed(0))
    )
    optimizer = task.optimizer(model, lr)
    for _ in range(steps):
        optimizer.zero_grad()
        task.loss(model, next(batches)).backward()
        optimizer.step()
    return model, batches
