"""Small models covering the operator families GACT must handle."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 7 * 7, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.max_pool2d(x, 2)
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class TransformerBlock(nn.Module):
    """Pre-LN block: LayerNorm, causal softmax attention with dropout, GELU MLP."""

    def __init__(self, dim: int = 32, heads: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(0.1)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = self.attn_drop(scores.masked_fill(mask, float("-inf")).softmax(-1))
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.ln2(x))
        return self.head(x.mean(1))


class GraphConvNet(nn.Module):
    """Two GCN layers with a sparse normalised adjacency."""

    def __init__(self, adj: torch.Tensor, d_in: int = 16, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.register_buffer("adj", adj)
        self.lin1 = nn.Linear(d_in, hidden)
        self.lin2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.sparse.mm(self.adj, self.lin1(x)))
        return torch.sparse.mm(self.adj, self.lin2(h))


def ring_adjacency(n: int) -> torch.Tensor:
    idx = torch.arange(n)
    rows = torch.cat([idx, idx, idx])
    cols = torch.cat([idx, (idx + 1) % n, (idx - 1) % n])
    vals = torch.full((3 * n,), 1.0 / 3.0)
    return torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (n, n)).coalesce()


def make_case(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model, an input batch and integer targets for ``name``."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "cnn":
        return (
            SmallCNN(),
            torch.randn(8, 1, 28, 28, generator=g),
            torch.randint(0, 10, (8,), generator=g),
        )
    if name == "mlp":
        return MLP(), torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    if name == "transformer":
        return (
            TransformerBlock(),
            torch.randn(8, 16, 32, generator=g),
            torch.randint(0, 10, (8,), generator=g),
        )
    if name == "gcn":
        n = 64
        return (
            GraphConvNet(ring_adjacency(n)),
            torch.randn(n, 16, generator=g),
            torch.randint(0, 4, (n,), generator=g),
        )
    raise ValueError(name)


CASES = ("cnn", "mlp", "transformer", "gcn")
