"""The example models: shapes, gradients, GCN normalisation, GPT causality."""

from __future__ import annotations

import pytest
import torch
from gact_examples.models import GNN, CharGPT, ResNetSmall


@pytest.mark.parametrize("kind", ["gcn", "sage", "gat"])
def test_gnn_forward_backward(kind):
    torch.manual_seed(0)
    n, f, c = 30, 12, 4
    x = torch.randn(n, f)
    src = torch.randint(0, n, (80,))
    dst = torch.randint(0, n, (80,))
    keep = src != dst
    edge_index = torch.stack([src[keep], dst[keep]])
    graph, aux = GNN.prepare(kind, edge_index, n)
    model = GNN(kind, f, 16, c)
    out = model(x, graph, aux)
    assert out.shape == (n, c)
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_gcn_normalisation_is_symmetric():
    edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
    graph, norm = GNN.prepare("gcn", edge_index, 3)
    deg = torch.tensor([2.0, 3.0, 2.0])  # with self loops
    expect = (deg[graph.src] * deg[graph.dst]).rsqrt()
    torch.testing.assert_close(norm, expect)


def test_gnn_rejects_unknown_model():
    with pytest.raises(ValueError, match="unknown model"):
        GNN("gin", 3, 4, 2)


@pytest.mark.parametrize(("in_ch", "size"), [(1, 28), (3, 32), (1, 8)])
def test_resnet_forward_backward(in_ch, size):
    model = ResNetSmall(in_ch, 10, width=8)
    out = model(torch.randn(4, in_ch, size, size))
    assert out.shape == (4, 10)
    out.logsumexp(1).mean().backward()
    assert model.stem[0].weight.grad is not None


def test_char_gpt_forward_backward_and_causality():
    torch.manual_seed(0)
    model = CharGPT(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    idx = torch.randint(0, 11, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 11) and loss.ndim == 0
    loss.backward()
    assert model.tok_emb.weight.grad is not None
    # changing a later token must not change earlier logits
    model.eval()
    idx2 = idx.clone()
    idx2[:, 10] = (idx2[:, 10] + 1) % 11
    torch.testing.assert_close(model(idx)[:, :10], model(idx2)[:, :10])
    with pytest.raises(ValueError, match="block size"):
        model(torch.zeros(1, 17, dtype=torch.long))
