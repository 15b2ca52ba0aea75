"""Activations written as several operations, recomputed from their saved input (NOTE
[Recomputed activations] in recomputed.py).

The activation classes below are transformers' (``transformers/activations.py``), copied with
their qualified names, so that these tests run without transformers installed;
``tests/integrations/test_recomputed_transformers.py`` runs the real classes.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from gact import Controller, GactConfig
from gact.errors import GactError
from gact.ledger import Kind
from gact.recomputed import RECOMPUTED_ACTIVATIONS, ActivationCall
from runtime_helpers import grads_of, keep_exact, relative_error
from torch import nn


class NewGELUActivation(nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))
        return 0.5 * input * (1.0 + torch.tanh(inner))


class FastGELUActivation(nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        inner = input * 0.7978845608 * (1.0 + 0.044715 * input * input)
        return 0.5 * input * (1.0 + torch.tanh(inner))


class AccurateGELUActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.precomputed_constant = math.sqrt(2 / math.pi)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        inner = self.precomputed_constant * (input + 0.044715 * torch.pow(input, 3))
        return 0.5 * input * (1 + torch.tanh(inner))


class QuickGELUActivation(nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input * torch.sigmoid(1.702 * input)


ACTIVATIONS = (NewGELUActivation, FastGELUActivation, AccurateGELUActivation, QuickGELUActivation)
for _cls in ACTIVATIONS:
    _cls.__module__ = "transformers.activations"
    assert (_cls.__module__, _cls.__qualname__) in RECOMPUTED_ACTIVATIONS


class MLP(nn.Module):
    """A transformer's MLP: up projection, the activation, down projection."""

    def __init__(self, act: type[nn.Module], width: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = act()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _step(model: nn.Module, x: torch.Tensor, **backward: object) -> torch.Tensor:
    model.zero_grad()
    loss = model(x).square().mean()
    loss.backward(**backward)  # type: ignore[arg-type]
    return loss


def _act_kinds(ctl: Controller) -> dict[str, Kind]:
    """Kind of every save the activation made in the last step, by key."""
    records, _ = ctl.ledger.view()
    return {key: rec.kind for key, rec in records.items() if key.startswith("act#")}


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda c: c.__name__)
def test_only_the_input_is_stored(act: type[nn.Module]) -> None:
    """Every save of the call but its input is recomputed: the activation's stored bytes are
    those of one quantized tensor, where they were 2-6 tensors."""
    stored = {}
    for recompute in (True, False):
        torch.manual_seed(0)
        model = MLP(act)
        ctl = Controller(model, GactConfig.from_level("L1", recompute_activations=recompute))
        with ctl:
            _step(model, torch.randn(32, 16, 64))
            _step(model, torch.randn(32, 16, 64))
        kinds = _act_kinds(ctl)
        records, _ = ctl.ledger.view()
        stored[recompute] = sum(records[key].stored_bytes for key in kinds)
        if recompute:
            assert sorted(kinds.values()).count(Kind.QUANTIZED) == 1  # the input
            assert Kind.RECOMPUTED in kinds.values()
            assert all(
                records[k].stored_bytes == 0 for k, v in kinds.items() if v is Kind.RECOMPUTED
            )
        else:
            assert Kind.RECOMPUTED not in kinds.values()
            assert list(kinds.values()).count(Kind.QUANTIZED) >= 2
    assert stored[True] * 2 <= stored[False]


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda c: c.__name__)
def test_gradients_exact_when_the_input_is_kept(act: type[nn.Module]) -> None:
    """With every save kept as it is (the call's input included), the recomputed intermediates
    are PyTorch's own, so every gradient is bit-identical to plain autograd's; the
    intermediates are still not stored."""
    torch.manual_seed(0)
    model = MLP(act)
    x = torch.randn(32, 16, 64)
    _step(model, x)
    expected = grads_of(model)
    ctl = Controller(model, GactConfig.from_level("L1"))
    with ctl:
        _step(model, x)  # names the keys
        keep_exact(ctl)
        _step(model, x)
        _step(model, x)  # the ledger shows the last completed step
    kinds = _act_kinds(ctl)
    assert Kind.QUANTIZED not in kinds.values() and Kind.RECOMPUTED in kinds.values()
    for got, want in zip(grads_of(model), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("act", [NewGELUActivation, QuickGELUActivation], ids=lambda c: c.__name__)
def test_fewer_bytes_and_less_error_than_stored_intermediates(act: type[nn.Module]) -> None:
    """The trade at equal widths is bytes for error; at fewer bytes the recomputation errs less.
    With only the activation's saves quantized (8 rounding seeds): its input alone at 4 bits
    takes fewer bytes than every intermediate at 2 bits (measured 68 against 144 and 72 KiB)
    and the gradients err 3-4x less (0.011 against 0.042 and 0.033, relative)."""
    torch.manual_seed(0)
    model = MLP(act)
    x = torch.randn(32, 16, 64)
    _step(model, x)
    exact = grads_of(model)
    errors, stored = {}, {}
    for level, recompute in (("L1", True), ("L1.2", False)):
        err = []
        for seed in range(8):
            cfg = GactConfig.from_level(level, seed=seed, recompute_activations=recompute)
            ctl = Controller(model, cfg)
            with ctl:
                _step(model, x)
                keep_exact(ctl, lambda key: not key.startswith("act#"))
                _step(model, x)
                _step(model, x)
            err.append(relative_error(grads_of(model), exact))
        records, _ = ctl.ledger.view()
        stored[recompute] = sum(r.stored_bytes for k, r in records.items() if k.startswith("act#"))
        errors[recompute] = sum(err) / len(err)
    assert stored[True] < stored[False]
    assert 2 * errors[True] < errors[False]


def test_in_place_change_of_the_input_raises() -> None:
    """The input is an ordinary save: modified in place after the call, the backward raises
    PyTorch's own message, as it does without GACT."""

    class InPlace(MLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.up(x)
            y = self.act(h)
            h.mul_(2)
            return self.down(y)

    model = InPlace(NewGELUActivation)
    with Controller(model, GactConfig.from_level("L1")):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _step(model, torch.randn(8, 16, 64))


def test_second_backward_recomputes() -> None:
    """``retain_graph=True``: the second backward recomputes the call again and gives the same
    gradients; each backward recomputes each call once (QuickGELU saves its sigmoid twice:
    one handle, two unpacks)."""
    calls = []
    original = ActivationCall._recompute

    def counted(self: ActivationCall) -> list[torch.Tensor]:
        calls.append(type(self.module).__name__)
        return original(self)

    torch.manual_seed(0)
    model = MLP(QuickGELUActivation)
    x = torch.randn(32, 16, 64)
    with Controller(model, GactConfig.from_level("L1")):
        model.zero_grad()
        loss = model(x).square().mean()
        ActivationCall._recompute = counted  # type: ignore[method-assign]
        try:
            loss.backward(retain_graph=True)
            first = grads_of(model)
            model.zero_grad()
            loss.backward()
        finally:
            ActivationCall._recompute = original  # type: ignore[method-assign]
    assert calls == ["QuickGELUActivation"] * 2
    for got, want in zip(grads_of(model), first):
        assert torch.equal(got, want)


def test_the_recomputation_leaves_nothing_behind() -> None:
    """What a recomputation makes dies with the backward that read it. (The first version
    returned the recomputed graph's own saved outputs from its capturing hook: a saved output
    holding its grad_fn is a cycle through C++ that Python never collects, and every step
    leaked the recomputed graph, 24 MiB per GPT-2 4x128 layer.)"""
    made: list[weakref.ref] = []
    original = ActivationCall._recompute

    def tracked(self: ActivationCall) -> list[torch.Tensor]:
        saves = original(self)
        made.extend(weakref.ref(t) for t in saves)
        return saves

    model = MLP(NewGELUActivation)
    with Controller(model, GactConfig.from_level("L1")):
        ActivationCall._recompute = tracked  # type: ignore[method-assign]
        try:
            _step(model, torch.randn(8, 16, 64))
        finally:
            ActivationCall._recompute = original  # type: ignore[method-assign]
    assert made and all(ref() is None for ref in made)


def test_autocast_state_is_restored_for_the_recomputation() -> None:
    """A call made under bf16 autocast is recomputed under it, although the backward runs
    outside: the recomputed saves have the original dtypes, and with the input kept the
    gradients are autocast's own."""

    class Upcast(nn.Module):  # the activation's ops run in the dtype autocast gives them
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP(NewGELUActivation)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.mlp(x).float()

    torch.manual_seed(0)
    model = Upcast()
    x = torch.randn(16, 16, 64)
    _step(model, x)
    expected = grads_of(model)
    ctl = Controller(model, GactConfig.from_level("L1"))
    with ctl:
        _step(model, x)
        records, _ = ctl.ledger.view()
        key = next(
            k for k, r in records.items() if k.startswith("mlp.act#") and r.kind is Kind.QUANTIZED
        )
        assert records[key].dtype is torch.bfloat16  # the input, made by autocast's linear
        keep_exact(ctl)
        _step(model, x)
        _step(model, x)
        records, _ = ctl.ledger.view()
        assert records[key].kind is Kind.KEPT
        assert any(
            r.kind is Kind.RECOMPUTED and r.dtype is torch.bfloat16 for r in records.values()
        )
    for got, want in zip(grads_of(model), expected):
        assert torch.equal(got, want)


def test_a_forward_changed_before_the_backward_raises() -> None:
    """If recomputing the call saves other tensors than the forward did, the unpack raises
    with what to do; it never hands autograd another tensor."""
    model = MLP(NewGELUActivation)
    with Controller(model, GactConfig.from_level("L1")):
        loss = model(torch.randn(8, 16, 64)).square().mean()
        model.act.forward = lambda x: torch.sigmoid(x)  # type: ignore[method-assign]
        with pytest.raises(GactError, match="recompute_activations=False"):
            loss.backward()


def test_an_input_replaced_by_a_later_pre_hook_raises() -> None:
    """A forward pre-hook registered after ``install_hook()`` that hands the activation another
    input: the call never saves the input GACT recorded, so its intermediates cannot be
    recomputed from it; the backward says so (and what to do) instead of recomputing from the
    wrong tensor."""
    model = MLP(QuickGELUActivation)
    with Controller(model, GactConfig.from_level("L1")):
        model.act.register_forward_pre_hook(lambda module, args: (args[0] * 1.0,))
        loss = model(torch.randn(8, 16, 64)).square().mean()
        with pytest.raises(GactError, match="never saved its input"):
            loss.backward()


@pytest.mark.parametrize("level", ["L0", "L2"])
def test_levels(level: str) -> None:
    """L0 stores what PyTorch would (nothing recomputed); the adaptive levels recompute, and
    the recomputed saves are not items of the allocation."""
    torch.manual_seed(0)
    model = MLP(NewGELUActivation)
    ctl = Controller(model, GactConfig.from_level(level))
    with ctl:
        for _ in range(3):
            _step(model, torch.randn(32, 16, 64))
            ctl.step()
    kinds = _act_kinds(ctl)
    assert (Kind.RECOMPUTED in kinds.values()) == (level != "L0")
    if level == "L2":
        recomputed = {k for k, v in kinds.items() if v is Kind.RECOMPUTED}
        assert recomputed and not recomputed & set(ctl.plan.bits)
        assert "recomputed" in ctl.report()
