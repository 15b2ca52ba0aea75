"""The public API: the seed README's usage, the idiomatic forms, and every error path."""

from __future__ import annotations

import gact
import pytest
import torch
import torch.nn.functional as F
from conftest import make_closure
from gact import ClosureError, Controller, GactConfig, HookStateError
from gact.controller import Controller as SeedController
from models import MLP, make_case
from torch import nn


def test_seed_readme_usage_trains() -> None:
    model, x, y = make_case("mlp")
    gact.set_optimization_level("L2")
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        controller = SeedController(model)
        controller.install_hook()
        losses = []
        for _ in range(30):

            def backprop() -> None:
                model.train()
                output = model(x)
                loss = F.cross_entropy(output, y)
                optimizer.zero_grad()
                loss.backward()
                losses.append(loss.item())

            controller.iterate(backprop)
            optimizer.step()
        controller.uninstall_hook()
    finally:
        gact.set_optimization_level("L2")
    assert losses[-1] < 0.5 * losses[0]
    assert controller.stats()["ratio"] > 1.0
    assert controller.stats()["adaptations"] == 1


def test_context_manager_and_plain_loop_at_fixed_level() -> None:
    model, x, y = make_case("cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    controller = Controller(model, GactConfig.from_level("L1", min_numel=0))
    with controller:
        assert controller.installed
        for _ in range(3):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            controller.step()
    assert not controller.installed
    st = controller.stats()
    assert st["step"] == 3 and st["compressed_tensors"] > 0
    assert st["average_bits"] == 4
    # Outside the context nothing is hooked any more.
    before = controller.ledger.current.copy()
    F.cross_entropy(model(x), y).backward()
    assert controller.ledger.current == before


def test_iterate_returns_the_closure_result() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1")) as controller:
        out = controller.iterate(make_closure(model, x, y))
    assert isinstance(out, torch.Tensor) and out.ndim == 0


def test_stats_and_report() -> None:
    model, x, y = make_case("cnn")
    with Controller(model, GactConfig.from_level("L1.2", min_numel=0)) as controller:
        controller.iterate(make_closure(model, x, y))
    st = controller.stats()
    for key in ("original_bytes", "stored_bytes", "ratio", "compressed_tensors", "skipped_tensors"):
        assert key in st
    assert st["ratio"] == pytest.approx(st["original_bytes"] / st["stored_bytes"])
    assert st["ratio"] > 5
    report = controller.report()
    assert "conv1#0" in report and "quantized" in report and "bits" in report.splitlines()[0]


def test_level_zero_measures_without_compressing() -> None:
    model, x, y = make_case("cnn")
    with Controller(model, GactConfig.from_level("L0")) as controller:
        controller.iterate(make_closure(model, x, y))
    st = controller.stats()
    assert st["original_bytes"] > 0 and st["stored_bytes"] == st["original_bytes"]
    assert st["compressed_tensors"] == 0


def test_state_errors() -> None:
    model, x, y = make_case("mlp")
    controller = Controller(model, GactConfig.from_level("L1"))
    with pytest.raises(HookStateError, match="before install_hook"):
        controller.iterate(make_closure(model, x, y))
    with pytest.raises(HookStateError, match="not installed"):
        controller.uninstall_hook()
    controller.install_hook()
    with pytest.raises(HookStateError, match="twice"):
        controller.install_hook()
    controller.uninstall_hook()
    assert not controller.installed


def test_uninstall_refuses_to_pop_someone_elses_hooks() -> None:
    model, _, _ = make_case("mlp")
    controller = Controller(model)
    controller.install_hook()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(HookStateError, match="exit it before"):
            controller.uninstall_hook()
    controller.uninstall_hook()


def test_bad_constructor_arguments() -> None:
    class NoParams(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match="no parameters"):
        Controller(NoParams())
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        Controller(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GactConfig"):
        Controller(MLP(), "L2")  # type: ignore[arg-type]


def test_closure_without_backward_is_an_error_and_controller_stays_usable() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L2", min_numel=0)) as controller:

        def no_backward() -> None:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y)

        with pytest.raises(ClosureError, match=r"loss\.backward"):
            controller.iterate(no_backward)
        controller.iterate(make_closure(model, x, y))
        assert controller.stats()["compressed_tensors"] > 0
    with pytest.raises(TypeError, match="callable"):
        controller.run_closure(42)  # type: ignore[arg-type]


def test_exception_in_closure_leaves_controller_consistent() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L2", min_numel=0)) as controller:

        def boom() -> None:
            model(x)
            raise RuntimeError("user bug")

        with pytest.raises(RuntimeError, match="user bug"):
            controller.iterate(boom)
        assert controller.installed and not controller.ledger.current
        controller.iterate(make_closure(model, x, y))
    assert controller.stats()["step"] == 1


def test_exception_inside_a_module_does_not_corrupt_scopes() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            if self.fail:
                raise RuntimeError("inner")
            return h

    model = Fails()
    x = torch.randn(2, 4, requires_grad=True)
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        with pytest.raises(RuntimeError, match="inner"):
            model(x)
        model.fail = False
        model(x).sum().backward()
    assert len(controller.tracker._stack()) == 1


def test_level_change_mid_step_is_refused() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        loss = F.cross_entropy(model(x), y)
        with pytest.raises(HookStateError, match="middle of a step"):
            controller.configure("L1.2")
        assert controller.config.level == "L1"
        loss.backward()
        controller.step()
        controller.configure("L1.2")
        controller.iterate(make_closure(model, x, y))
    assert controller.stats()["average_bits"] == 2
    with pytest.raises(ValueError, match="unknown optimization level"):
        controller.configure("L5")
