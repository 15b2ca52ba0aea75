"""Real models on real data, as the memory, speed and comparison benchmarks train them.

``gpt2`` and ``bert`` are ``transformers`` models from configs (GPT-2 4 layers of width 128 on
32 x 128 tiny-shakespeare characters; BERT 2 layers, classifying which half of the corpus a
window comes from), ``resnet18`` torchvision's layout on CIFAR-10 batches of 64, ``char-gpt`` the
char-GPT example's memory configuration (6 layers, 64 x 128 characters), ``mnist`` the MNIST
example's (ResNet-small with 3 blocks per stage, batch 512), ``gcn`` a two-layer GCN on Cora
(full batch, the Planetoid split) and ``encoder6`` six ``nn.TransformerEncoderLayer`` blocks
(width 256, 8 heads, causal) predicting the next of 32 x 128 tiny-shakespeare characters.
Model, optimizer state and batches live on the device ``workload`` is given (the CPU by default);
the data and the batch sequence are the same on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .data import load_char_corpus, load_cifar10, load_mnist, load_planetoid
from .models import GNN, CharGPT, ResNet18, ResNetSmall

__all__ = ["MODELS", "Workload", "parse_models", "workload"]

MODELS = ("gpt2", "bert", "resnet18", "char-gpt", "mnist", "gcn", "encoder6")


@dataclass
class Workload:
    """One model and how it trains.

    Attributes:
        model: the model, in train mode.
        loss: the loss of training batch ``i`` (a deterministic sequence; some workloads have
            one fixed batch).
        optimizer: AdamW 1e-3 for the transformers, Adam 0.01 (weight decay 5e-4) for the
            GCN, SGD 0.01 with momentum 0.9 for the CNNs.
        evaluate: the held-out loss and accuracy (``nan`` where there is none), in eval mode
            without gradients; the model is back in train mode afterwards.
        blocks: qualified names of the modules that checkpointing wraps one by one (ResNet's
            BasicBlocks, the transformers' layers, the GCN's convolutions).
    """

    model: nn.Module
    loss: Callable[[int], torch.Tensor]
    optimizer: torch.optim.Optimizer
    evaluate: Callable[[], dict[str, float]]
    blocks: tuple[str, ...]

    def compile(self, backend: str) -> None:
        """Compile the model in place (``nn.Module.compile``) with ``backend``, or, for
        ``BACKEND/blocks``, each of ``blocks`` alone, as large models are compiled block by
        block."""
        if backend.endswith("/blocks"):
            for block in self.blocks:
                self.model.get_submodule(block).compile(backend=backend.removesuffix("/blocks"))
        else:
            self.model.compile(backend=backend)


def workload(name: str, data: str, device: torch.device | str = "cpu") -> Workload:
    """The workload ``name`` (one of ``MODELS``) on the datasets under ``data``, trained on
    ``device``.

    Raises:
        ValueError: an unknown ``name``.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return _BUILDERS[name](data, torch.device(device))


def parse_models(text: str) -> list[str]:
    """The comma-separated model names of a ``--models`` option.

    Raises:
        ValueError: a name not in ``MODELS``.

    Example:
        >>> parse_models("gpt2, mnist")
        ['gpt2', 'mnist']
    """
    models = [m.strip() for m in text.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    return models


def _evaluator(
    model: nn.Module, logits_and_labels: Callable[[], tuple[torch.Tensor, torch.Tensor]]
) -> Callable[[], dict[str, float]]:
    def evaluate() -> dict[str, float]:
        model.eval()
        try:
            with torch.no_grad():
                logits, labels = logits_and_labels()
                loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten())
                acc = (logits.argmax(-1) == labels).float().mean()
        finally:
            model.train()
        return {"loss": float(loss), "accuracy": float(acc)}

    return evaluate


def _text(name: str, data: str, device: torch.device) -> Workload:
    corpus = load_char_corpus(data)
    ids = torch.from_numpy(corpus["train"]).to(device)
    val = torch.from_numpy(corpus["val"]).to(device)
    vocab = len(corpus["chars"])
    batch = 64 if name == "char-gpt" else 32
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - 129, (batch,), generator=gen)
    x = ids[starts[:, None] + torch.arange(128)]
    val_starts = torch.linspace(0, len(val) - 129, 16).long()
    vx = val[val_starts[:, None] + torch.arange(128)]
    if name == "encoder6":
        return _encoder6(ids, vx, vocab, batch, device)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=4,
            n_embd=128,
            n_head=4,
            vocab_size=vocab,
            n_positions=128,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,  # training: no key/value cache
        )
        gpt2 = GPT2LMHeadModel(config).to(device).train()

        def windows(i: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 + i)
            s = torch.randint(0, len(ids) - 129, (batch,), generator=g)
            return ids[s[:, None] + torch.arange(128)]

        def gpt2_loss(i: int) -> torch.Tensor:
            w = windows(i)
            return gpt2(input_ids=w, labels=w).loss

        evaluate = _evaluator(gpt2, lambda: (gpt2(input_ids=vx).logits[:, :-1], vx[:, 1:]))
        blocks = tuple(f"transformer.h.{i}" for i in range(config.n_layer))
        return Workload(gpt2, gpt2_loss, _adamw(gpt2), evaluate, blocks)
    if name == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=512, max_position_embeddings=128, num_labels=2,
        )  # fmt: skip
        bert = BertForSequenceClassification(config).to(device).train()
        y = (starts > len(ids) // 2).long().to(device)
        vy = (val_starts > len(val) // 2).long().to(device)
        evaluate = _evaluator(bert, lambda: (bert(input_ids=vx).logits, vy))
        blocks = tuple(f"bert.encoder.layer.{i}" for i in range(config.num_hidden_layers))
        return Workload(
            bert, lambda i: bert(input_ids=x, labels=y).loss, _adamw(bert), evaluate, blocks
        )
    gpt = CharGPT(vocab, block_size=128, n_layer=6, n_head=4, n_embd=128, dropout=0.1)
    gpt = gpt.to(device).train()
    evaluate = _evaluator(gpt, lambda: (gpt(vx)[:, :-1], vx[:, 1:]))
    return Workload(
        gpt,
        lambda i: F.cross_entropy(gpt(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten()),
        _adamw(gpt),
        evaluate,
        tuple(f"blocks.{i}" for i in range(6)),
    )


class _Encoder(nn.Module):
    def __init__(self, vocab: int, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 8, batch_first=True) for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(h)


def _encoder6(
    ids: torch.Tensor, vx: torch.Tensor, vocab: int, batch: int, device: torch.device
) -> Workload:
    enc = _Encoder(vocab).to(device).train()

    def encoder_loss(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(2000 + i)
        s = torch.randint(0, len(ids) - 129, (batch,), generator=g)
        w = ids[s[:, None] + torch.arange(128)]
        return F.cross_entropy(enc(w)[:, :-1].flatten(0, 1), w[:, 1:].flatten())

    evaluate = _evaluator(enc, lambda: (enc(vx)[:, :-1], vx[:, 1:]))
    blocks = tuple(f"layers.{i}" for i in range(len(enc.layers)))
    return Workload(enc, encoder_loss, _adamw(enc), evaluate, blocks)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _resnet18(data: str, device: torch.device) -> Workload:
    cifar = load_cifar10(data)
    images = torch.from_numpy(cifar["x_train"])
    labels = torch.from_numpy(cifar["y_train"])
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    test = torch.linspace(0, len(cifar["x_test"]) - 1, 512).long()
    tx = torch.from_numpy(cifar["x_test"])[test].to(device).float().div(255)
    tx = tx.permute(0, 3, 1, 2).contiguous()
    ty = torch.from_numpy(cifar["y_test"])[test].to(device)
    resnet = ResNet18().to(device).train()

    def resnet_loss(i: int) -> torch.Tensor:
        pick = order[(i * 64) % len(order) :][:64]
        x = images[pick].to(device).float().div(255).permute(0, 3, 1, 2).contiguous()
        return F.cross_entropy(resnet(x), labels[pick].to(device))

    blocks = tuple(f"layer{s}.{b}" for s in range(1, 5) for b in range(2))
    evaluate = _evaluator(resnet, lambda: (resnet(tx), ty))
    return Workload(resnet, resnet_loss, _sgd(resnet), evaluate, blocks)


def _mnist(data: str, device: torch.device) -> Workload:
    mnist = load_mnist(data)
    x = torch.from_numpy(mnist["x_train"][:512]).to(device).float().div(255).unsqueeze(1)
    y = torch.from_numpy(mnist["y_train"][:512]).to(device).long()
    vx = torch.from_numpy(mnist["x_test"][:512]).to(device).float().div(255).unsqueeze(1)
    vy = torch.from_numpy(mnist["y_test"][:512]).to(device).long()
    small = ResNetSmall(in_channels=1, width=16, blocks=3).to(device).train()
    blocks = tuple(f"layers.{i}" for i in range(len(small.layers)))
    return Workload(
        small,
        lambda i: F.cross_entropy(small(x), y),
        _sgd(small),
        _evaluator(small, lambda: (small(vx), vy)),
        blocks,
    )


def _gcn(data: str, device: torch.device) -> Workload:
    cora = load_planetoid(data, "cora")
    x, y, train_idx, test_idx, edges = (
        torch.from_numpy(cora[k]).to(device)
        for k in ("x", "y", "train_idx", "test_idx", "edge_index")
    )
    graph, aux = GNN.prepare("gcn", edges, x.shape[0])
    gcn = GNN("gcn", x.shape[1], 64, int(cora["num_classes"])).to(device).train()
    optimizer = torch.optim.Adam(gcn.parameters(), lr=0.01, weight_decay=5e-4)
    evaluate = _evaluator(gcn, lambda: (gcn(x, graph, aux)[test_idx], y[test_idx]))
    return Workload(
        gcn,
        lambda i: F.cross_entropy(gcn(x, graph, aux)[train_idx], y[train_idx]),
        optimizer,
        evaluate,
        ("conv1", "conv2"),
    )


_BUILDERS: dict[str, Callable[[str, torch.device], Workload]] = {
    "gpt2": lambda data, device: _text("gpt2", data, device),
    "bert": lambda data, device: _text("bert", data, device),
    "char-gpt": lambda data, device: _text("char-gpt", data, device),
    "resnet18": _resnet18,
    "mnist": _mnist,
    "gcn": _gcn,
    "encoder6": lambda data, device: _text("encoder6", data, device),
}
