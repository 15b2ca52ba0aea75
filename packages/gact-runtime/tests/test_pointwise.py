"""Derivative tables for GELU and SiLU inputs (NOTE [Derivative tables] in gact/pointwise.py)."""

from __future__ import annotations

from typing import Any

import gact_kernels
import pytest
import torch
import torch.nn.functional as F
from gact import ConfigError, Controller, GactConfig, GactError
from gact.adapt import Items
from gact.ledger import live_tensor_peak
from gact.pointwise import (
    DERIVATIVES,
    MAX_TABLE_BITS,
    derivative_table,
    table_is_better,
)
from gact.saved import SavedCompressed
from runtime_helpers import record_saves
from torch import nn

FUNCTIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class Block(nn.Module):
    """``lin2(f(lin1(x)))``, with hooks that capture the gradient at f's input and output."""

    def __init__(self, act: str = "gelu", extra_mul: bool = False) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(32, 512), nn.Linear(512, 4)
        self.act, self.extra_mul = FUNCTIONS[act], extra_mul
        self.pre: torch.Tensor | None = None
        self.grads: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin1(x)
        a = self.act(h)
        if self.extra_mul:  # a second op saves h after the activation did
            a = a + h * h
        if h.requires_grad:
            self.pre = h.detach()
            h.register_hook(lambda g: self.grads.__setitem__("pre", g))
            a.register_hook(lambda g: self.grads.__setitem__("post", g))
        return self.lin2(a)


def _step(model: nn.Module, config: GactConfig | None, x: torch.Tensor, c: torch.Tensor) -> Any:
    def closure() -> None:
        model.zero_grad()
        (model(x) * c).sum().backward()

    if config is None:
        closure()
        return None
    with Controller(model, config) as ctl:
        ctl.iterate(closure)
    return ctl


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(256, 32, generator=gen), torch.randn(256, 4, generator=gen)


@pytest.mark.parametrize("name", sorted(DERIVATIVES))
def test_derivatives_match_autograd(name):
    z = torch.linspace(-8, 8, 4001, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(FUNCTIONS[name](z).sum(), z)
    assert torch.allclose(DERIVATIVES[name][0](z.detach()), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bits", range(1, MAX_TABLE_BITS + 1))
@pytest.mark.parametrize("name", sorted(DERIVATIVES))
def test_tables_hold_their_levels_at_representative_inputs(name, bits):
    table = derivative_table(name, bits)
    assert len(table.levels) <= 2**bits and len(table.bounds) == len(table.levels) - 1
    assert torch.all(table.bounds[1:] > table.bounds[:-1])
    prime = DERIVATIVES[name][0]
    assert torch.allclose(prime(table.inputs), table.levels, rtol=0, atol=1e-6)
    # each representative input lies in its own interval
    assert torch.equal(table.codes(table.inputs).long(), torch.arange(len(table.levels)))


def test_table_errors_are_checked():
    with pytest.raises(ValueError, match="no derivative table"):
        derivative_table("tanh", 2)
    with pytest.raises(ValueError, match="bits"):
        derivative_table("gelu", MAX_TABLE_BITS + 1)


def test_tables_are_chosen_where_they_beat_rounding():
    torch.manual_seed(0)
    for bits in range(1, MAX_TABLE_BITS + 1):
        table = derivative_table("gelu", bits)
        assert table_is_better(torch.randn(64 * 256), table, group_size=256)
    # a narrow range, which per-group rounding resolves finely, keeps quantization
    narrow = 0.1 + 0.1 * torch.rand(64 * 256)
    assert not table_is_better(narrow, derivative_table("gelu", 2), group_size=256)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_the_backward_multiplies_by_the_tables_derivative(act, monkeypatch):
    torch.manual_seed(0)
    model = Block(act)
    x, c = _data()
    ctl = Controller(model, GactConfig.from_level("L1.2", min_numel=0))
    saved = record_saves(ctl, monkeypatch)
    with ctl:
        ctl.iterate(lambda: (model.zero_grad(), (model(x) * c).sum().backward()))
    tables = [s for s in saved if isinstance(s, SavedCompressed) and s.table is not None]
    assert len(tables) == 1 and isinstance(tables[0].held, gact_kernels.PackedInts)
    table = derivative_table(act, 2)
    expected = model.grads["post"] * table.levels.float()[table.codes(model.pre).long()]
    assert torch.allclose(model.grads["pre"], expected, rtol=1e-4, atol=1e-6)
    exact = model.grads["post"] * DERIVATIVES[act][0](model.pre.double()).float()
    assert float((model.grads["pre"] - exact).norm() / exact.norm()) > 1e-2  # not a no-op


def test_tables_cut_the_input_gradient_error_at_two_bits():
    torch.manual_seed(0)
    model = Block()
    x, c = _data()
    _step(model, None, x, c)
    exact = model.grads["pre"].clone()
    errors = {}
    for tables in (False, True):
        total = 0.0
        for seed in range(4):
            config = GactConfig.from_level("L1.2", min_numel=0, seed=seed, derivative_tables=tables)
            _step(model, config, x, c)
            total += float((model.grads["pre"] - exact).norm() / exact.norm())
        errors[tables] = total / 4
    # GELU's input is one of three quantized tensors, but the only one on this path besides
    # the first layer's input (the gradient at h does not depend on it)
    assert errors[True] < 0.5 * errors[False], errors


def test_switched_off_the_input_is_quantized(monkeypatch):
    model = Block()
    x, c = _data()
    ctl = Controller(model, GactConfig.from_level("L1.2", min_numel=0, derivative_tables=False))
    saved = record_saves(ctl, monkeypatch)
    with ctl:
        ctl.iterate(lambda: (model.zero_grad(), (model(x) * c).sum().backward()))
    assert all(getattr(s, "table", None) is None for s in saved)


def _record_with_probe_flag(ctl: Controller, monkeypatch: Any) -> list[tuple[object, bool]]:
    """What ``ctl``'s hooks return for every save, with whether a probe was running."""
    calls: list[tuple[object, bool]] = []
    pack = ctl.hooks.pack_own

    def recording(tensor: torch.Tensor, **kwargs: Any) -> object:
        calls.append((pack(tensor, **kwargs), ctl.plan.probe is not None))
        return calls[-1][0]

    monkeypatch.setattr(ctl.hooks, "pack_own", recording)
    return calls


@pytest.mark.parametrize("level, tables", [("L1", True), ("L1.1", False)])
def test_tables_only_at_four_bits_or_fewer(level, tables, monkeypatch):
    model = Block()
    x, c = _data()
    ctl = Controller(model, GactConfig.from_level(level, min_numel=0))
    calls = _record_with_probe_flag(ctl, monkeypatch)
    with ctl:
        ctl.iterate(lambda: (model.zero_grad(), (model(x) * c).sum().backward()))
    assert calls
    assert any(getattr(s, "table", None) is not None for s, _ in calls) is tables


def test_probes_quantize(monkeypatch):
    model = Block(extra_mul=True)  # h * h needs probes (the GELU's input alone is measured)
    x, c = _data()
    ctl = Controller(model, GactConfig.from_level("L2", min_numel=0, adapt_first_gap=0))
    calls = _record_with_probe_flag(ctl, monkeypatch)
    with ctl:
        ctl.iterate(lambda: (model.zero_grad(), (model(x) * c).sum().backward()))
    probed = [s for s, probing in calls if probing and isinstance(s, SavedCompressed)]
    assert probed and all(s.table is None for s in probed)
    assert any(getattr(s, "table", None) is not None for s, probing in calls if not probing)


def test_a_table_is_never_shared_with_another_ops_save(monkeypatch):
    torch.manual_seed(0)
    model = Block(extra_mul=True)
    x, c = _data()
    _step(model, None, x, c)
    exact = [p.grad.clone() for p in model.parameters()]
    errors = {}
    for tables in (False, True):
        ctl = Controller(model, GactConfig.from_level("L1", min_numel=0, derivative_tables=tables))
        saved = record_saves(ctl, monkeypatch)
        with ctl:
            ctl.iterate(lambda: (model.zero_grad(), (model(x) * c).sum().backward()))
        with_table = [s for s in saved if isinstance(s, SavedCompressed) and s.table is not None]
        assert len(with_table) == int(tables)
        got = [p.grad for p in model.parameters()]
        errors[tables] = sum(float((g - e).norm() ** 2) for g, e in zip(got, exact)) ** 0.5
    # h * h saved h again after GELU did: had it been handed the table's representative
    # inputs, its gradient would be far off; it got its own quantized copy
    assert errors[True] <= 1.2 * errors[False], errors


def test_another_node_unpacking_a_table_raises():
    model = Block()
    ctl = Controller(model, GactConfig.from_level("L1.2", min_numel=0))
    table = derivative_table("gelu", 2)

    def pack(t: torch.Tensor) -> SavedCompressed:
        saved = SavedCompressed(t, "k", gact_kernels.pack_ints(table.codes(t.detach())), ctl.hooks)
        saved.table = table
        return saved

    a = torch.randn(300, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.unpack()):
        y = (a * a).sum()
    with pytest.raises(GactError, match="MulBackward0 unpacked the input of a gelu call"):
        y.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype, monkeypatch):
    torch.manual_seed(0)
    model = Block().to(dtype)
    x, c = (t.to(dtype) for t in _data())
    ctl = Controller(model, GactConfig.from_level("L1.2", min_numel=0))
    saved = record_saves(ctl, monkeypatch)
    with ctl:
        ctl.iterate(lambda: (model.zero_grad(), (model(x) * c).sum().backward()))
    assert any(getattr(s, "table", None) is not None for s in saved)
    assert model.grads["pre"].dtype is dtype
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_allocation_counts_the_tables_group_header():
    model = Block()
    x, c = _data()
    ctl = _step(model, GactConfig.from_level("L2", min_numel=0), x, c)
    sites, _ = ctl.ledger.last, None
    items = Items.of(sites, 0.25, {})
    gelu = [k for k in items.keys if sites[k].table]
    assert len(gelu) == 1
    i = items.keys.index(gelu[0])
    assert items.overhead_bits[i] == pytest.approx(0.25 + 0.25 / 8)
    assert all(items.overhead_bits[j] == 0.25 for j in range(len(items.keys)) if j != i)


def test_config_rejects_a_non_boolean_switch():
    with pytest.raises(ConfigError, match="derivative_tables must be True or False"):
        GactConfig(derivative_tables="yes")


def test_tables_are_judged_per_key_not_per_save(monkeypatch):
    # NOTE [Derivative tables]: once per key, again when its width changes and every
    # REJUDGE_STEPS steps; judging every save cost several times the save itself
    import gact.pointwise

    judged: list[int] = []
    real = gact.pointwise.table_is_better

    def counting(*args: Any, **kwargs: Any) -> bool:
        judged.append(len(judged))
        return real(*args, **kwargs)

    monkeypatch.setattr(gact.pointwise, "table_is_better", counting)
    monkeypatch.setattr(gact.pointwise, "REJUDGE_STEPS", 3)
    model = nn.Sequential(Block(), Block(act="silu"))  # two table candidates per forward
    model[0].lin2, model[1].lin1 = nn.Linear(512, 32), nn.Linear(32, 512)
    x, _ = _data()
    ctl = Controller(model, GactConfig.from_level("L1", min_numel=0))
    counts = []
    with ctl:
        for _ in range(5):
            model.zero_grad()
            model(x).sum().backward()
            ctl.step()
            counts.append(len(judged))
    assert counts == [2, 2, 2, 4, 4]  # judged at steps 0 and 3
    verdicts = ctl.hooks._verdicts
    key = next(k for k in verdicts if k[0] == "table")
    bits, step, verdict = verdicts[key]
    verdicts[key] = (bits + 1, step, verdict)  # as if the key's width had changed since
    with ctl:
        model.zero_grad()
        model(x).sum().backward()
    assert len(judged) == 5


def test_a_tables_values_need_no_index_copy_of_the_whole_tensor() -> None:
    """The unpack of a derivative table looks its codes up in pieces: an int32 copy of every
    code (indices for ``index_select``) made the backward hold 2.25x the activation at that
    node where a dequantize holds 1x (a GELU of 4M elements: peak 1.05x fp32's step, 0.97x
    without tables). The lookup of 4M codes now holds its output and one piece of indices
    (an eighth: 0.5 bytes per element), and gives the same values."""
    table = derivative_table("gelu", 4)
    codes = torch.randint(0, len(table.levels), (1 << 22,), dtype=torch.uint8)
    expected = table.inputs.float()[codes.long()]
    values, peak = live_tensor_peak(lambda: table.values(codes.view(1024, -1), torch.float32))
    assert torch.equal(values.reshape(-1), expected) and values.shape == (1024, 4096)
    assert peak <= 1.15 * values.nbytes
