"""PyTorch Geometric under a Controller: the integer index tensors of gathers and scatters
(``edge_index``) are stored losslessly, so gradients through them are exact at every level.

The GCN, GraphSAGE and GAT models themselves train at every level in test_model_matrix.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_geometric")

from gact import LEVELS, Controller, GactConfig
from torch_geometric.nn import SimpleConv

COMPRESSING = [name for name, level in LEVELS.items() if level.compresses]


class _Propagation(torch.nn.Module):
    """Two rounds of sum-aggregation of learned node states: its backward needs only the
    gather and scatter indices, no floating-point activation."""

    def __init__(self, nodes: int, width: int) -> None:
        super().__init__()
        self.states = torch.nn.Parameter(torch.randn(nodes, width))
        self.conv = SimpleConv(aggr="sum")

    def forward(self, edge_index: torch.Tensor) -> torch.Tensor:
        return self.conv(self.conv(self.states, edge_index), edge_index)


@pytest.mark.parametrize("level", COMPRESSING)
def test_gradients_through_edge_index_are_exact(level: str) -> None:
    gen = torch.Generator().manual_seed(1)
    edge_index = torch.randint(0, 300, (2, 2000), generator=gen)
    weights = torch.randn(300, 16, generator=gen)
    model = _Propagation(300, 16)
    (model(edge_index) * weights).sum().backward()
    reference = model.states.grad.clone()
    model.zero_grad()
    with Controller(model, GactConfig.from_level(level)) as controller:
        (model(edge_index) * weights).sum().backward()
    assert torch.equal(model.states.grad, reference)
    rows = [line.split() for line in controller.report().splitlines()]
    packed = [row for row in rows if row[:1] == ["conv#0:int64:1d"] and row[3] == "packed"]
    # the gather index, a view of edge_index that both rounds save, stored once in fewer bits
    assert packed and packed[0][6] == "1"  # (NOTE [Aliased saves])
    assert controller.stats()["deduplicated_saves"] >= 1
