"""Real models on real data, one training batch each: what the memory and speed benchmarks run.

``gpt2`` and ``bert`` are ``transformers`` models from configs (GPT-2 4 layers of width 128 on
32 x 128 tiny-shakespeare characters; BERT 2 layers, classifying which half of the corpus a
window comes from), ``resnet18`` torchvision's layout on 64 CIFAR-10 images, ``char-gpt`` the
char-GPT example's memory configuration (6 layers, 64 x 128 characters) and ``mnist`` the MNIST
example's (ResNet-small with 3 blocks per stage, batch 512).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .data import load_char_corpus, load_cifar10, load_mnist
from .models import CharGPT, ResNet18, ResNetSmall

__all__ = ["MODELS", "workload"]

MODELS = ("gpt2", "bert", "resnet18", "char-gpt", "mnist")


def workload(
    name: str, data: str
) -> tuple[nn.Module, Callable[[], torch.Tensor], torch.optim.Optimizer]:
    """The model (in train mode), a function computing the loss of its fixed batch, and its
    optimizer (AdamW 1e-3 for the transformers, SGD 0.01 with momentum 0.9 for the CNNs).

    Args:
        name: one of ``MODELS``.
        data: the folder holding ``tinyshakespeare/``, ``cifar10-jpg/`` and ``mnist/``.

    Raises:
        ValueError: an unknown ``name``.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    model, loss_of = _build(name, data)
    model.train()
    if name in ("gpt2", "bert", "char-gpt"):
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, loss_of, optimizer


def _build(name: str, data: str) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    if name in ("gpt2", "bert", "char-gpt"):
        corpus = load_char_corpus(data)
        ids = torch.from_numpy(corpus["train"])
        vocab = len(corpus["chars"])
        batch = 64 if name == "char-gpt" else 32
        starts = torch.randint(0, len(ids) - 129, (batch,), generator=gen)
        x = ids[starts[:, None] + torch.arange(128)]
        if name == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=vocab, n_positions=128)
            gpt2 = GPT2LMHeadModel(config)
            return gpt2, lambda: gpt2(input_ids=x, labels=x).loss
        if name == "bert":
            from transformers import BertConfig, BertForSequenceClassification

            config = BertConfig(
                vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=512, max_position_embeddings=128, num_labels=2,
            )  # fmt: skip
            bert = BertForSequenceClassification(config)
            y = (starts > len(ids) // 2).long()
            return bert, lambda: bert(input_ids=x, labels=y).loss
        gpt = CharGPT(vocab, block_size=128, n_layer=6, n_head=4, n_embd=128, dropout=0.1)
        return gpt, lambda: F.cross_entropy(gpt(x).flatten(0, 1), x.flatten())
    if name == "resnet18":
        images = load_cifar10(data)["x_train"][:64]
        x = torch.from_numpy(images).float().div(255).permute(0, 3, 1, 2).contiguous()
        y = torch.arange(len(x)) % 10
        resnet = ResNet18()
        return resnet, lambda: F.cross_entropy(resnet(x), y)
    mnist = load_mnist(data)
    x = torch.from_numpy(mnist["x_train"][:512]).float().div(255).unsqueeze(1)
    y = torch.from_numpy(mnist["y_train"][:512]).long()
    small = ResNetSmall(in_channels=1, width=16, blocks=3)
    return small, lambda: F.cross_entropy(small(x), y)
