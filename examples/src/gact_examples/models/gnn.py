"""GCN, GraphSAGE and GAT in plain PyTorch with index ops (no graph library).

A graph is a :class:`Graph`: ``src``/``dst`` int64 edge endpoints (messages flow src -> dst) on
``num_nodes`` nodes. Aggregation is ``index_add_`` over ``dst``; the softmax over a node's
incoming edges in GAT uses ``scatter_reduce`` (amax) for stability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GNN", "KINDS", "GATConv", "GCNConv", "Graph", "SAGEConv", "aggregate"]
KINDS = ("gcn", "sage", "gat")


@dataclass
class Graph:
    """Edges as two int64 index vectors (messages flow ``src -> dst``) on ``num_nodes`` nodes."""

    src: torch.Tensor
    dst: torch.Tensor
    num_nodes: int

    @classmethod
    def from_edge_index(
        cls, edge_index: torch.Tensor, num_nodes: int, self_loops: bool = False
    ) -> Graph:
        src, dst = edge_index[0], edge_index[1]
        if self_loops:
            loop = torch.arange(num_nodes, device=edge_index.device)
            src, dst = torch.cat([src, loop]), torch.cat([dst, loop])
        return cls(src.contiguous(), dst.contiguous(), num_nodes)

    def in_degree(self) -> torch.Tensor:
        deg = torch.zeros(self.num_nodes, device=self.dst.device)
        return deg.index_add_(0, self.dst, torch.ones_like(self.dst, dtype=deg.dtype))

    def to(self, device: torch.device | str) -> Graph:
        return Graph(self.src.to(device), self.dst.to(device), self.num_nodes)


def aggregate(graph: Graph, messages: torch.Tensor) -> torch.Tensor:
    """Sum ``messages`` (one row per edge) into their destination nodes."""
    out = messages.new_zeros((graph.num_nodes, *messages.shape[1:]))
    return out.index_add_(0, graph.dst, messages)


class GCNConv(nn.Module):
    """Kipf & Welling: D^-1/2 (A + I) D^-1/2 X W (the graph passed in has self-loops)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor, graph: Graph, norm: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return aggregate(graph, h.index_select(0, graph.src) * norm.unsqueeze(1)) + self.bias


class SAGEConv(nn.Module):
    """GraphSAGE, mean aggregator: W_self x_i + W_neigh mean_{j in N(i)} x_j."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.lin_self = nn.Linear(in_dim, out_dim)
        self.lin_neigh = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor, graph: Graph, inv_deg: torch.Tensor) -> torch.Tensor:
        mean = aggregate(graph, x.index_select(0, graph.src)) * inv_deg.unsqueeze(1)
        return self.lin_self(x) + self.lin_neigh(mean)


class GATConv(nn.Module):
    """Velickovic et al.: multi-head additive attention over incoming edges (with self-loops)."""

    def __init__(self, in_dim: int, out_dim: int, heads: int, concat: bool, dropout: float) -> None:
        super().__init__()
        self.heads, self.out_dim, self.concat = heads, out_dim, concat
        self.lin = nn.Linear(in_dim, heads * out_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_dim))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_dim))
        self.bias = nn.Parameter(torch.zeros(heads * out_dim if concat else out_dim))
        self.dropout = dropout
        nn.init.xavier_uniform_(self.lin.weight)
        nn.init.xavier_uniform_(self.att_src)
        nn.init.xavier_uniform_(self.att_dst)

    def forward(self, x: torch.Tensor, graph: Graph) -> torch.Tensor:
        h = self.lin(x).view(-1, self.heads, self.out_dim)  # N x H x C
        a_src = (h * self.att_src).sum(-1)  # N x H
        a_dst = (h * self.att_dst).sum(-1)
        score = F.leaky_relu(a_src[graph.src] + a_dst[graph.dst], 0.2)  # E x H
        # softmax over the incoming edges of each destination node
        node_max = score.new_full((graph.num_nodes, self.heads), float("-inf"))
        node_max = node_max.scatter_reduce(
            0, graph.dst.unsqueeze(1).expand_as(score), score.detach(), reduce="amax"
        )
        e = torch.exp(score - node_max[graph.dst])
        denom = aggregate(graph, e)[graph.dst]
        alpha = F.dropout(e / (denom + 1e-16), self.dropout, self.training)
        out = aggregate(graph, h[graph.src] * alpha.unsqueeze(-1))  # N x H x C
        out = out.reshape(-1, self.heads * self.out_dim) if self.concat else out.mean(1)
        return out + self.bias


class GNN(nn.Module):
    """Two graph layers with ReLU (GAT: ELU) and dropout, as in the papers' Cora setups.

    Args:
        kind: ``"gcn"``, ``"sage"`` or ``"gat"``.
        in_dim: input features per node.
        hidden: hidden width (GAT: split over ``heads``).
        num_classes: outputs per node.
        dropout: dropout on the inputs of both layers (and GAT's attention weights).
        heads: GAT attention heads of the first layer.

    Raises:
        ValueError: an unknown ``kind``.

    Example:
        >>> edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
        >>> graph, aux = GNN.prepare("gcn", edge_index, num_nodes=3)
        >>> GNN("gcn", in_dim=5, hidden=8, num_classes=2)(torch.randn(3, 5), graph, aux).shape
        torch.Size([3, 2])
    """

    def __init__(
        self,
        kind: str,
        in_dim: int,
        hidden: int,
        num_classes: int,
        dropout: float = 0.5,
        heads: int = 8,
    ) -> None:
        super().__init__()
        self.kind, self.dropout = kind, dropout
        if kind == "gcn":
            self.conv1, self.conv2 = GCNConv(in_dim, hidden), GCNConv(hidden, num_classes)
        elif kind == "sage":
            self.conv1, self.conv2 = SAGEConv(in_dim, hidden), SAGEConv(hidden, num_classes)
        elif kind == "gat":
            self.conv1 = GATConv(in_dim, hidden // heads, heads, concat=True, dropout=dropout)
            self.conv2 = GATConv(hidden, num_classes, 1, concat=False, dropout=dropout)
        else:
            raise ValueError(f"unknown model {kind!r}; choose one of {', '.join(KINDS)}")

    @staticmethod
    def prepare(kind: str, edge_index: torch.Tensor, num_nodes: int) -> tuple[Graph, torch.Tensor]:
        """The graph each model expects plus its per-edge/per-node normalisation constants."""
        if kind == "sage":
            graph = Graph.from_edge_index(edge_index, num_nodes, self_loops=False)
            return graph, 1.0 / graph.in_degree().clamp_min(1.0)
        graph = Graph.from_edge_index(edge_index, num_nodes, self_loops=True)
        dinv = graph.in_degree().pow(-0.5)
        return graph, dinv[graph.src] * dinv[graph.dst]  # GCN edge weights (unused by GAT)

    def _conv(
        self, conv: nn.Module, x: torch.Tensor, graph: Graph, aux: torch.Tensor
    ) -> torch.Tensor:
        return conv(x, graph) if self.kind == "gat" else conv(x, graph, aux)

    def forward(self, x: torch.Tensor, graph: Graph, aux: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = self._conv(self.conv1, x, graph, aux)
        x = F.elu(x) if self.kind == "gat" else F.relu(x)
        x = F.dropout(x, self.dropout, self.training)
        return self._conv(self.conv2, x, graph, aux)
