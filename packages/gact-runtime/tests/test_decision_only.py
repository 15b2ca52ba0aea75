"""Saves read only through comparisons, stored as their outcomes (NOTE [Decision-only saves] in
saved.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from gact import Controller, GactConfig
from gact.ledger import Kind
from torch import nn

Fn = Callable[[torch.Tensor], torch.Tensor]

# every function whose backward reads its save only through comparisons with constants (the
# rules with ``only_decisions`` in decision_rules.py), in place where PyTorch has it: in-place
# versions save their output, the others their input
DECIDING: dict[str, Fn] = {
    "relu": F.relu,
    "relu_": lambda x: x.relu_(),
    "F.relu inplace": lambda x: F.relu(x, inplace=True),
    "torch.relu": torch.relu,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "leaky_relu_": lambda x: F.leaky_relu_(x, 0.1),
    "hardtanh": lambda x: F.hardtanh(x, -1.0, 1.0),
    "hardtanh_": lambda x: F.hardtanh_(x, -0.5, 2.0),
    "relu6": F.relu6,
    "hardsigmoid": F.hardsigmoid,
    "threshold": lambda x: F.threshold(x, 0.5, -2.0),
    "threshold_": lambda x: F.threshold_(x, 0.5, -2.0),
    "clamp": lambda x: x.clamp(-1.0, 1.0),
    "clamp_": lambda x: x.clamp_(min=-0.5),
    "clamp_min": lambda x: torch.clamp_min(x, 0.5),
    "clamp_max": lambda x: x.clamp_max(-0.5),
    "clip": lambda x: torch.clip(x, -2.0, 0.0),
    "hardshrink": lambda x: F.hardshrink(x, 0.5),
    "softshrink": lambda x: F.softshrink(x, 0.5),
    "abs": torch.abs,
    "abs_": lambda x: x.abs_(),
}

# values at and next to every threshold above, and random ones
EDGES = torch.tensor(
    [
        t + d
        for t in (-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 6.0)
        for d in (-1e-3, 0.0, 1e-3)
    ]
)


class Deciding(nn.Module):
    """``fn`` of an input shifted by a parameter: the only save is ``fn``'s, and the
    parameter's gradient meets no rounding but what that save carries."""

    def __init__(self, fn: Fn, n: int) -> None:
        super().__init__()
        self.fn, self.shift = fn, nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x + self.shift)


def _inputs(n: int) -> torch.Tensor:
    torch.manual_seed(0)
    rows = torch.randn(7, n) * 3
    rows[0, : EDGES.numel()] = EDGES
    return rows


def _exact(name: str, x: torch.Tensor) -> tuple[Deciding, torch.Tensor, torch.Tensor]:
    """``Deciding(DECIDING[name])``, the output weights ``c`` of its loss ``(out * c).sum()``
    (taken outside the model, so kept), and its parameter's fp32 gradient."""
    model = Deciding(DECIDING[name], x.shape[1])
    out = model(x.clone())
    c = torch.randn_like(out)
    (out * c).sum().backward()
    return model, c, model.shift.grad.clone()


@pytest.mark.parametrize("name", sorted(DECIDING))
@pytest.mark.parametrize("level", ["L1", "L2.2"])
def test_a_deciding_save_is_stored_as_its_outcomes(name: str, level: str) -> None:
    """At 1 bit per comparison, and with the gradient fp32's bit for bit (it reads nothing
    else), at every level. Before, the save was quantized at the level's width (4 bits at L1,
    on the zero-exact grid for ReLU) and its decisions were kept exact by masks on top."""
    x = _inputs(64)
    model, c, exact = _exact(name, x)
    with Controller(model, GactConfig.from_level(level, min_numel=0)) as controller:
        for _ in range(2):
            model.zero_grad()
            (model(x.clone()) * c).sum().backward()
            controller.step()
            assert torch.equal(model.shift.grad, exact)
    records = [r for r in controller.ledger.last.values() if r.key.startswith("<root>#")]
    assert [r.kind for r in records] == [Kind.DECISIONS], controller.report()
    (rec,) = records
    comparisons = rec.mask_bits
    assert 1 <= comparisons <= 2
    assert rec.stored_bytes == comparisons * x.numel() // 8  # 448 elements: whole bytes
    assert "decisions" in controller.report()


def test_rrelu_noise_is_read_for_its_values() -> None:
    """In training, RReLU's backward multiplies by the random slopes it saved: that save is no
    decision-only one (it used to be counted as one by the sensitivity meter)."""
    model = Deciding(lambda x: F.rrelu(x, training=True), 64)
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        model(_inputs(64)).sum().backward()
        controller.step()
    kinds = {r.kind for r in controller.ledger.last.values() if r.key.startswith("<root>#")}
    assert Kind.DECISIONS not in kinds and Kind.QUANTIZED in kinds


class Stem(nn.Module):
    """The stem of torchvision's ResNets: convolution, BatchNorm, in-place ReLU, max pooling;
    then a convolution reading the pooled map, or (``reads``) the ReLU output itself too."""

    def __init__(self, reads: str | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.head = nn.Conv2d(8, 4, 3, padding=1)
        self.reads = reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.bn(self.conv(x)))
        out = self.head(self.pool(h)).flatten(1)
        if self.reads == "square":  # reads h's values after the ReLU saved it
            out = out + (h * h).flatten(1).sum(1, keepdim=True)
        elif self.reads == "view":  # reads them through a view
            out = out + h.flatten(1)[:, :1] * h.flatten(1)[:, 1:2]
        return out


def _stem_step(model: nn.Module, controller: Controller | None, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    torch.manual_seed(1)
    model(x).square().mean().backward()
    if controller is not None:
        controller.step()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_the_resnet_stem_stores_its_relu_output_as_signs() -> None:
    """The ReLU output that only the ReLU's backward reads (the max pooling reads it for its
    shape) takes 1 bit per element, not 4 zero-exact bits and their group headers."""
    torch.manual_seed(0)
    model, x = Stem(), torch.randn(16, 3, 16, 16)
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        _stem_step(model, controller, x)
    by_key = {r.key: r for r in controller.ledger.last.values()}
    relu = [r for k, r in by_key.items() if k.startswith("relu#")]
    pool = [r for k, r in by_key.items() if k.startswith("pool#") and r.dtype == torch.float32]
    numel = 16 * 8 * 16 * 16
    assert [(r.kind, r.stored_bytes) for r in relu] == [(Kind.DECISIONS, numel // 8)]
    assert [(r.kind, r.stored_bytes) for r in pool] == [(Kind.SHAPE, 0)]
    # autograd would hold the ReLU output once: counted at the ReLU's save, not the pooling's
    assert relu[0].original_bytes == 4 * numel and pool[0].original_bytes == 0


@pytest.mark.parametrize("reads", ["square", "view"])
def test_a_relu_output_read_for_its_values_is_compressed_as_before(reads: str) -> None:
    """Another op saving the ReLU output (or a view of it) for its values turns the ReLU's
    save into what it was (zero-exact bits, shared by every save of it) at once, so that the
    step stores no extra bits, and from the next forward on it is compressed so at its first
    save. The gradients of two controllers with the same seed, one of which learnt this one
    step earlier, are identical: the turned save is the save it would have been."""
    torch.manual_seed(0)
    model, x = Stem(reads), torch.randn(16, 3, 16, 16)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = GactConfig.from_level("L1", min_numel=0, seed=3)
    with Controller(model, cfg) as first:
        first_grad = _stem_step(model, first, x)
    records = first.ledger.last
    relu = [r for k, r in records.items() if k.startswith("relu#")]
    assert [r.kind for r in relu] == [Kind.QUANTIZED] and relu[0].zero_exact
    assert not any(r.kind is Kind.DECISIONS for r in records.values())
    assert first.plan.value_read == {relu[0].key}
    assert first.ledger.last_deduplicated == 2  # both of the product's saves share the ReLU's
    model.load_state_dict(start)
    with Controller(model, cfg) as second:
        second.plan.value_read.add(relu[0].key)  # learnt before its first forward
        second_grad = _stem_step(model, second, x)
    assert torch.equal(first_grad, second_grad)
    assert {k: (r.kind, r.stored_bytes) for k, r in second.ledger.last.items()} == {
        k: (r.kind, r.stored_bytes) for k, r in records.items()
    }


def test_an_in_place_change_after_a_decision_only_save_is_caught() -> None:
    """PyTorch refuses a backward after a saved tensor changed in place; storing only the
    outcomes must keep that check."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x + model.shift)
        out = h.sum()
        h.add_(1)
        return out

    model = Deciding(torch.relu, 64)
    model.forward = forward  # type: ignore[method-assign]
    with Controller(model, GactConfig.from_level("L1", min_numel=0)):
        loss = model(_inputs(64))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_level_l0_stores_a_relu_output_as_pytorch_would() -> None:
    model = Deciding(torch.relu, 64)
    with Controller(model, GactConfig.from_level("L0", min_numel=0)) as controller:
        model(_inputs(64)).sum().backward()
        controller.step()
    kinds = [r.kind for r in controller.ledger.last.values() if r.key.startswith("<root>#")]
    assert kinds == [Kind.KEPT]


@pytest.mark.parametrize("name", ["relu", "hardtanh", "leaky_relu", "relu6", "hardsigmoid"])
def test_a_compiled_graph_stores_a_deciding_save_as_its_outcomes(name: str) -> None:
    """Under aot_eager the compiled backward reads the save only through comparisons (``le``,
    ``hardtanh_backward``, ``leaky_relu_backward``...): stored as their outcomes too, the
    gradient fp32's bit for bit (``CompiledSite.decisions_only``)."""
    torch._dynamo.reset()
    x = _inputs(64)
    model, c, exact = _exact(name, x)
    run = torch.compile(model, backend="aot_eager")
    with Controller(run, GactConfig.from_level("L1", min_numel=0)) as controller:
        for _ in range(2):
            model.zero_grad()
            (run(x.clone()) * c).sum().backward()
            controller.step()
            assert torch.equal(model.shift.grad, exact)
    kinds = [r.kind for k, r in controller.ledger.last.items() if "@" in k]
    assert kinds == [Kind.DECISIONS], controller.report()


@pytest.mark.parametrize("name", ["relu", "leaky_relu", "hardtanh", "clamp"])
def test_a_save_holding_a_nan_is_compressed_as_before(name: str) -> None:
    """A NaN lies in no comparison's region, and backwards treat it differently (fp32's ReLU
    passes the gradient there, LeakyReLU scales it, clamp stops it): such a save is quantized,
    its NaN group kept exactly, and the gradient is fp32's, NaN for NaN."""
    x = _inputs(64)
    x[3, 5] = float("nan")
    model, c, exact = _exact(name, x)
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        model.zero_grad()
        (model(x.clone()) * c).sum().backward()
        controller.step()
    kinds = [r.kind for k, r in controller.ledger.last.items() if k.startswith("<root>#")]
    assert kinds == [Kind.QUANTIZED]
    assert torch.equal(model.shift.grad, exact)


def test_an_adaptive_level_spends_its_average_over_the_decided_elements_too() -> None:
    """L2 averages 4 bits per element over what it compresses, the ReLU output stored at 1 bit
    included, as over a two-valued tensor pinned at 1 bit: the 3 bits it does not need go to
    the quantized tensors. Counted out of the average, L2 stored 11% fewer bytes on the
    ResNet-18 layout with 2.6x its gradient error (BENCHMARKS.md)."""
    torch.manual_seed(0)
    model, x = Stem(), torch.randn(16, 3, 16, 16)
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1, adapt_budget=None)
    with Controller(model, cfg) as controller:
        for _ in range(4):
            controller.iterate(lambda: _stem_step(model, None, x))
    assert controller.stats()["adaptations"] >= 1
    records = controller.ledger.last.values()
    covered = [r for r in records if r.kind in (Kind.QUANTIZED, Kind.DECISIONS)]
    assert any(r.kind is Kind.DECISIONS for r in covered)
    budget = 4 * sum(r.numel for r in covered) / 8
    stored = sum(r.stored_bytes for r in covered)
    assert 0.9 * budget < stored <= budget + 16 * len(covered)


def test_inductors_decision_masks_count_as_decisions_and_its_dropout_mask_does_not() -> None:
    """Inductor saves a ReLU's ``le`` mask, not its output: the same decision eager code stores
    alone, counted alike by an adaptive level's average (CompiledSite.decided); a dropout's
    mask (a comparison of a random draw) is a mask as in eager code."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Dropout(0.2), nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )  # fmt: skip
    x = torch.randn(8, 3, 16, 16)
    run = torch.compile(model, backend="inductor")
    with Controller(run, GactConfig.from_level("L1", min_numel=0)) as controller:
        for _ in range(2):
            run(x).square().mean().backward()
            controller.step()
    bools = {r.kind for r in controller.ledger.last.values() if r.dtype == torch.bool}
    assert bools == {Kind.DECISIONS, Kind.MASK}, controller.report()
