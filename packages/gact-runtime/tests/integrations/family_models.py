"""Small models of each family, built from configs with random weights, and a fixed batch each
(imported as a module by the integration tests; pytest puts this folder on ``sys.path``).

Every builder imports its library when it is called, so a missing library skips only the
families that need it (``requires``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Loss = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Family:
    """A model family: ``build()`` returns a fresh model (seeded) and its loss on a fixed batch."""

    name: str
    requires: str  # the library to import, "torch" for none
    build: Callable[[], tuple[nn.Module, Loss]]


def _tokens(vocab: int, batch: int = 4, length: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def gpt2() -> tuple[nn.Module, Loss]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    ids = _tokens(128)
    return model, lambda: model(input_ids=ids, labels=ids).loss


def bert() -> tuple[nn.Module, Loss]:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
        num_labels=3,
    )
    model = BertForSequenceClassification(config)
    ids, labels = _tokens(128), torch.tensor([0, 1, 2, 1])
    return model, lambda: model(input_ids=ids, labels=labels).loss


def llama() -> tuple[nn.Module, Loss]:
    """A LLaMA-style decoder: RMSNorm, SiLU-gated MLP, rotary embeddings, SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    ids = _tokens(128)
    return model, lambda: model(input_ids=ids, labels=ids).loss


def vit() -> tuple[nn.Module, Loss]:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=4,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        num_labels=10,
    )
    model = ViTForImageClassification(config)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 3, 5, 9])
    return model, lambda: model(pixel_values=images, labels=labels).loss


def _graph(nodes: int = 256, features: int = 1433, edges: int = 1024) -> tuple[torch.Tensor, ...]:
    """A random graph shaped like Cora: wide bag-of-words features, average degree 4."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(nodes, features, generator=gen)
    edge_index = torch.randint(0, nodes, (2, edges), generator=gen)
    y = torch.randint(0, 7, (nodes,), generator=gen)
    return x, edge_index, y


def gcn() -> tuple[nn.Module, Loss]:
    from torch_geometric.nn import GCN

    x, edge_index, y = _graph()
    model = GCN(x.shape[1], 64, num_layers=2, out_channels=7, dropout=0.5)
    return model, lambda: F.cross_entropy(model(x, edge_index), y)


def sage() -> tuple[nn.Module, Loss]:
    from torch_geometric.nn import GraphSAGE

    x, edge_index, y = _graph()
    model = GraphSAGE(x.shape[1], 64, num_layers=2, out_channels=7, dropout=0.5)
    return model, lambda: F.cross_entropy(model(x, edge_index), y)


def gat() -> tuple[nn.Module, Loss]:
    from torch_geometric.nn import GAT

    x, edge_index, y = _graph()
    model = GAT(x.shape[1], 64, num_layers=2, out_channels=7, heads=4, dropout=0.5)
    return model, lambda: F.cross_entropy(model(x, edge_index), y)


def cnn() -> tuple[nn.Module, Loss]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(8)
    return model, lambda: F.cross_entropy(model(images), labels)


FAMILIES = {
    family.name: family
    for family in (
        Family("gpt2", "transformers", gpt2),
        Family("bert", "transformers", bert),
        Family("llama", "transformers", llama),
        Family("vit", "transformers", vit),
        Family("gcn", "torch_geometric", gcn),
        Family("sage", "torch_geometric", sage),
        Family("gat", "torch_geometric", gat),
        Family("cnn", "torch", cnn),
    )
}
