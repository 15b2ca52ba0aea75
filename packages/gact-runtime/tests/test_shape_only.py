"""Saves whose values the backward never reads (NOTE [Shape-only saves] in decision_rules.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from gact import Controller, GactConfig
from gact.ledger import Kind
from torch import nn

Scatter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _flat(idx: torch.Tensor, width: int = 32) -> torch.Tensor:
    """Rows ``idx`` of a ``[n, width]`` tensor as flat element indices."""
    return (idx[:, None] * width + torch.arange(width)).flatten()


# every spelling of the ops whose backward reads the messages ``src`` only for their shape
SPELLINGS: dict[str, Scatter] = {
    "Tensor.index_add_": lambda out, idx, src: out.index_add_(0, idx, src),
    "Tensor.index_add": lambda out, idx, src: out.index_add(0, idx, src, alpha=2.0),
    "torch.index_add": lambda out, idx, src: torch.index_add(out, 0, idx, src),
    "aten.index_add": lambda out, idx, src: torch.ops.aten.index_add(out, 0, idx, src),
    "Tensor.index_copy_": lambda out, idx, src: out.index_copy_(0, idx, src),
    "torch.index_copy": lambda out, idx, src: torch.index_copy(out, 0, idx, src),
    "Tensor.put_": lambda out, idx, src: out.put_(_flat(idx), src, accumulate=True),
    "torch.put": lambda out, idx, src: torch.put(out, _flat(idx), src),
    "torch.take_along_dim": lambda out, idx, src: (
        out + torch.take_along_dim(src, idx[:, None].expand_as(src), 0)
    ),
    "Tensor.take_along_dim, flat": lambda out, idx, src: (
        out + src.take_along_dim(_flat(idx)).view_as(out)
    ),
    "torch.gather": lambda out, idx, src: out + torch.gather(src, 0, idx[:, None].expand_as(src)),
    "Tensor.gather": lambda out, idx, src: out + src.gather(0, idx[:, None].expand_as(src)),
}


class Aggregate(nn.Module):
    """Messages ``lin(x)[src]`` summed (or copied) into rows of a zero tensor: the pattern of
    message passing in GNNs, whose messages are often the largest activation."""

    def __init__(self, scatter: Scatter, reuse: str | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 32)
        self.scatter, self.reuse = scatter, reuse

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        messages = self.lin(x)
        out = x.new_zeros(idx.numel(), 32)
        if self.reuse == "before":  # the messages saved by another op first, then by the scatter
            extra = (messages * messages).sum()
            return self.scatter(out, idx, messages).sum() + extra
        if self.reuse == "after":
            res = self.scatter(out, idx, messages).sum()
            return res + (messages * messages).sum()
        return self.scatter(out, idx, messages).sum()


def _run(model: nn.Module, level: str | None, x: torch.Tensor, idx: torch.Tensor):
    model.zero_grad()
    x = x.clone().requires_grad_()
    if level is None:
        model(x, idx).backward()
        return x.grad, model.lin.bias.grad.clone(), None
    with Controller(model, GactConfig.from_level(level, min_numel=0)) as controller:
        model(x, idx).backward()
        controller.step()
    return x.grad, model.lin.bias.grad.clone(), controller


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_scatters_and_gathers_store_their_messages_as_their_shape(spelling: str) -> None:
    """The source is stored as nothing but its shape, and the gradients that no rounding
    reaches are fp32's bit for bit: the source's gradient is ``grad.index_select(dim, index)``,
    from which the linear layer's input gradient (through its weight, kept) and its bias
    gradient follow."""
    torch.manual_seed(0)
    model = Aggregate(SPELLINGS[spelling])
    x, idx = torch.randn(64, 24), torch.randperm(64)  # a permutation: index_copy is unique
    ref_x, ref_b, _ = _run(model, None, x, idx)
    got_x, got_b, controller = _run(model, "L1", x, idx)
    assert torch.equal(got_x, ref_x) and torch.equal(got_b, ref_b)
    records = [  # the messages (flattened by take_along_dim without a dim)
        r
        for r in controller.ledger.last.values()
        if r.dtype.is_floating_point and math.prod(r.shape) == 64 * 32
    ]
    assert [(r.kind, r.stored_bytes) for r in records] == [(Kind.SHAPE, 0)], records
    assert "shape" in controller.report()


@pytest.mark.parametrize("reuse", ["before", "after"])
def test_a_source_that_another_op_reads_is_stored_for_it(reuse: str) -> None:
    """``messages * messages`` reads the messages' values: that save is compressed as usual
    whether it comes before or after the scatter's, and its gradient is unbiased (the two
    saves are never merged into one that stores no values)."""
    torch.manual_seed(0)
    model = Aggregate(SPELLINGS["Tensor.index_add_"], reuse=reuse)
    x, idx = torch.randn(64, 24), torch.randint(0, 64, (64,))
    ref_x, _, _ = _run(model, None, x, idx)
    grads = []
    for seed in range(40):
        model.zero_grad()
        xs = x.clone().requires_grad_()
        with Controller(model, GactConfig.from_level("L1", min_numel=0, seed=seed)) as c:
            model(xs, idx).backward()
            c.step()
        grads.append(xs.grad)
    grads = torch.stack(grads)
    assert torch.isfinite(grads).all()
    kinds = sorted(r.kind.value for r in c.ledger.last.values() if r.shape == (64, 32))
    assert kinds == ["quantized", "shape"]
    # autograd would hold the messages once: their bytes count once, whichever save came first
    held = [r.original_bytes for r in c.ledger.last.values() if r.shape == (64, 32)]
    assert sum(held) == 64 * 32 * 4
    # mean over 40 seeds within 5 standard errors of fp32's, everywhere the error is not 0
    # (false alarm per element < 6e-7; 1,536 elements: < 1e-3)
    mean, se = grads.mean(0), grads.std(0) / 40**0.5
    assert ((mean - ref_x).abs() <= 5 * se + 1e-6).all()
    assert (grads.std(0) > 0).any()  # the messages' save is rounded, not kept


def test_an_in_place_change_of_a_shape_only_source_is_still_caught() -> None:
    """PyTorch refuses a backward after a saved tensor changed in place; storing only the
    shape must not lose that check."""
    model = Aggregate(SPELLINGS["Tensor.index_add_"])
    x, idx = torch.randn(8, 24), torch.arange(8)

    def forward(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        messages = model.lin(x)
        out = x.new_zeros(8, 32).index_add_(0, idx, messages)
        messages.add_(1)
        return out.sum()

    model.forward = forward  # type: ignore[method-assign]
    with Controller(model, GactConfig.from_level("L1", min_numel=0)):
        loss = model(x, idx)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_shape_only_save_read_for_its_values_is_loud() -> None:
    """If a backward ever read a shape-only source's values (another PyTorch's formula), it
    gets NaNs, never plausible wrong numbers."""
    from gact.saved import SavedShape

    saved = SavedShape(torch.randn(3, 4), "k")
    values = saved.unpack()
    assert values.shape == (3, 4) and torch.isnan(values).all()
    assert values.untyped_storage().nbytes() == 4  # one element, expanded


def test_level_l0_stores_the_source_as_pytorch_would() -> None:
    """L0 measures and stores nothing differently: its ledger is the baseline the other levels
    are compared with."""
    torch.manual_seed(0)
    model = Aggregate(SPELLINGS["Tensor.index_add_"])
    x, idx = torch.randn(64, 24), torch.randperm(64)
    _, _, controller = _run(model, "L0", x, idx)
    records = [r for r in controller.ledger.last.values() if r.shape == (64, 32)]
    assert [r.kind for r in records] == [Kind.KEPT]
    assert records[0].stored_bytes == records[0].original_bytes > 0


# every pooling whose backward reads its input only for its shape: max pooling scatters the
# gradient through the indices it saved, average pooling spreads it over the window
POOLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "max 2d": lambda x: F.max_pool2d(x, 3, 2, 1),
    "max 2d channels_last": lambda x: F.max_pool2d(
        x.contiguous(memory_format=torch.channels_last), 2
    ),
    "max 2d with indices": lambda x: F.max_pool2d(x, 2, return_indices=True)[0],
    "max 1d": lambda x: F.max_pool1d(x.flatten(2), 3),
    "max 3d": lambda x: F.max_pool3d(x.unsqueeze(2).expand(-1, -1, 4, -1, -1), 2),
    "adaptive max 2d": lambda x: F.adaptive_max_pool2d(x, 3),
    "adaptive max 1d": lambda x: F.adaptive_max_pool1d(x.flatten(2), 5),
    "avg 2d": lambda x: F.avg_pool2d(x, 3, 2, 1),
    "avg 2d channels_last": lambda x: F.avg_pool2d(
        x.contiguous(memory_format=torch.channels_last), 2
    ),
    "avg 1d": lambda x: F.avg_pool1d(x.flatten(2), 3),
    "avg 3d": lambda x: F.avg_pool3d(x.unsqueeze(2).expand(-1, -1, 4, -1, -1), 2),
    "adaptive avg 2d": lambda x: F.adaptive_avg_pool2d(x, 3),
    "adaptive avg 1d": lambda x: F.adaptive_avg_pool1d(x.flatten(2), 5),
    "adaptive avg 3d": lambda x: F.adaptive_avg_pool3d(x.unsqueeze(2), (1, 2, 3)),
}


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_pooling_reads_its_input_only_for_its_shape(pool: str) -> None:
    """The premise of storing a pooling's input as its shape: with NaNs in place of every
    floating-point tensor its backward saved, the input's gradient is exact, bit for bit."""
    fn = POOLS[pool]
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    g = torch.randn_like(fn(x))
    (exact,) = torch.autograd.grad(fn(x), x, g)

    def pack(t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, math.nan) if t.is_floating_point() else t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x * 1.0)  # a non-leaf input, saved through the hook
    (grad,) = torch.autograd.grad(y, x, g)
    assert torch.equal(grad, exact)


class Pooled(nn.Module):
    """A pooling of a linear map's output: the pooling's save is the only one of that
    output, and the gradients upstream of it meet no rounding."""

    def __init__(self, pool: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv2d(3, 3, 1), pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(x))


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_a_pooling_input_is_stored_as_its_shape(pool: str) -> None:
    """The pooled tensor is stored as its shape alone, and the gradients of the layer below
    (whose own save, its input, is the model's input: compressed, but read only for the
    weight) are fp32's bit for bit where no rounding reaches them: the input's and the
    bias's."""
    torch.manual_seed(0)
    model = Pooled(POOLS[pool])
    x, c = torch.randn(4, 3, 9, 9), None
    grads = []
    for level in (None, "L1"):
        model.zero_grad()
        xs = x.clone().requires_grad_()
        if level is None:
            out = model(xs)
            c = torch.randn_like(out)
            (out * c).sum().backward()
        else:
            with Controller(model, GactConfig.from_level(level, min_numel=0)) as controller:
                (model(xs) * c).sum().backward()
                controller.step()
        grads.append((xs.grad, model.conv.bias.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    pooled = [  # the conv's own save (its input) is the first; then the pooling's
        r
        for r in controller.ledger.last.values()
        if r.key.startswith("<root>#") and r.dtype.is_floating_point
    ]
    assert [(r.kind, r.stored_bytes) for r in pooled] == [(Kind.SHAPE, 0)], controller.report()
