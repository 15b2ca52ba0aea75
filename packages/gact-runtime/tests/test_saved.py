"""What is compressed and how: parameters, masks, duplicates, small and integer tensors."""

from __future__ import annotations

import logging

import gact_kernels
import pytest
import torch
import torch.nn.functional as F
from conftest import make_closure
from gact import Controller, GactConfig
from gact.ledger import Kind
from gact.saved import Saved
from models import CASES, make_case
from torch import nn


class Spy:
    """Wraps a controller's pack hook to see what it returned for every saved tensor."""

    def __init__(self, controller: Controller, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[torch.Tensor, object]] = []
        pack = controller.hooks.pack

        def spy(t: torch.Tensor) -> object:
            out = pack(t)
            self.seen.append((t, out))
            return out

        monkeypatch.setattr(controller.hooks, "pack", spy)


def _copies_a_parameter(t: torch.Tensor, params: list[torch.Tensor]) -> bool:
    """Judged by value, independently of how the runtime recognises parameters and buffers."""
    for p in params:
        for view in (p, p.t()) if p.dim() == 2 else (p,):
            if view.shape == t.shape and torch.equal(view.detach().to(t.dtype), t.detach()):
                return True
    return False


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("autocast", [False, True])
def test_parameters_are_never_compressed(
    case: str, autocast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, x, y = make_case(case)
    controller = Controller(model, GactConfig.from_level("L1", min_numel=0))
    spy = Spy(controller, monkeypatch)
    params = [*model.parameters(), *(b for b in model.buffers() if b.layout is torch.strided)]
    with controller, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        controller.iterate(make_closure(model, x, y))
    n_param_saves = 0
    for t, out in spy.seen:
        if _copies_a_parameter(t, params):
            n_param_saves += 1
            assert out is t, f"parameter copy {tuple(t.shape)} {t.dtype} was compressed"
    assert n_param_saves > 0
    assert controller.stats()["parameter_saves"] == n_param_saves
    assert controller.stats()["compressed_tensors"] > 0


def test_parameters_recognised_after_model_to(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, y = make_case("mlp")
    controller = Controller(model, GactConfig.from_level("L1", min_numel=0))
    model.to(torch.float64).to(torch.float32)  # new storages for every parameter
    spy = Spy(controller, monkeypatch)
    with controller:
        controller.iterate(make_closure(model, x, y))
    params = list(model.parameters())
    for t, out in spy.seen:
        if any(t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for p in params):
            assert out is t


def test_inputs_without_grad_are_compressed(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, y = make_case("cnn")
    controller = Controller(model, GactConfig.from_level("L1", min_numel=0))
    spy = Spy(controller, monkeypatch)
    with controller:
        controller.iterate(make_closure(model, x, y))
    assert any(t is x and isinstance(out, Saved) for t, out in spy.seen)


def test_dropout_masks_are_packed_losslessly(monkeypatch: pytest.MonkeyPatch) -> None:
    class MaskNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            mask = h > 0  # a bool tensor saved by torch.where
            return torch.where(mask, h, 0.1 * h).sum(-1)

    model = MaskNet()
    x = torch.randn(64, 64)
    controller = Controller(model, GactConfig.from_level("L1", min_numel=0))
    spy = Spy(controller, monkeypatch)
    with controller:
        model(x).sum().backward()
    masks = [(t, out) for t, out in spy.seen if t.dtype is torch.bool]
    assert masks
    for t, out in masks:
        assert isinstance(out, Saved) and isinstance(out.payload, gact_kernels.PackedMask)
        assert torch.equal(out.restore(), t)
        assert out.payload.nbytes < t.numel()  # 1 bit per element instead of 8


def test_a_tensor_saved_by_several_ops_is_stored_once(monkeypatch: pytest.MonkeyPatch) -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))  # tanh saves its output h
            return self.b(h) * h  # linear saves h again, mul saves h once more

    model = Shared()
    x = torch.randn(32, 64)
    controller = Controller(model, GactConfig.from_level("L1", min_numel=0))
    spy = Spy(controller, monkeypatch)
    with controller:
        loss = model(x).sum()
        loss.backward()
        controller.step()
    outs = [out for _, out in spy.seen if isinstance(out, Saved)]
    assert len(outs) > len({id(o) for o in outs})
    assert controller.stats()["deduplicated_saves"] >= 2


def test_small_and_integer_tensors_are_kept() -> None:
    emb = nn.Embedding(100, 16)
    model = nn.Sequential(emb, nn.Flatten(), nn.Linear(16 * 8, 4))
    idx = torch.randint(0, 100, (4, 8))
    with Controller(model, GactConfig.from_level("L1", min_numel=10_000)) as controller:
        model(idx).sum().backward()
        controller.step()
    records = controller.ledger.last
    assert records and all(r.kind in (Kind.KEPT, Kind.PARAMETER) for r in records.values())
    assert controller.stats()["skipped_tensors"] > 0
    assert any(r.dtype == torch.int64 for r in records.values())


def test_level_three_on_cpu_behaves_as_level_two(caplog: pytest.LogCaptureFixture) -> None:
    model, x, y = make_case("cnn")
    results = {}
    for level in ("L2", "L3"):
        m, _, _ = make_case("cnn")
        m.load_state_dict(model.state_dict())
        with caplog.at_level(logging.WARNING, logger="gact"):
            with Controller(m, GactConfig.from_level(level, min_numel=0)) as controller:
                for _ in range(2):
                    controller.iterate(make_closure(m, x, y))
        results[level] = ([p.grad.clone() for p in m.parameters()], controller.stats())
    warnings = [r for r in caplog.records if "L3" in r.getMessage()]
    assert len(warnings) == 1
    for a, b in zip(results["L2"][0], results["L3"][0]):
        assert torch.equal(a, b)
    assert results["L2"][1]["stored_bytes"] == results["L3"][1]["stored_bytes"]


def test_float64_activations_are_kept() -> None:
    model = nn.Linear(32, 32).double()
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        F.relu(model(x)).sum().backward()
        controller.step()
    assert controller.stats()["compressed_tensors"] == 0
    assert controller.stats()["skipped_tensors"] > 0
