"""torch.compile: both spellings train, and the compiled graphs' saves are kept as they are
(see NOTE [Compiled forwards] in scope.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gact import Controller, GactConfig, GactWarning
from gact.ledger import Kind
from torch import nn


def _pooling_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 10),
    )  # fmt: skip


def _train(model: nn.Module, run: nn.Module, controller: Controller | None) -> list[torch.Tensor]:
    x, y = torch.randn(16, 1, 16, 16), torch.randint(0, 10, (16,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = F.cross_entropy(run(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if controller is not None:
            controller.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("spelling", ["Controller(torch.compile(model))", "torch.compile after"])
def test_compiled_models_train_and_keep_their_saves(backend: str, spelling: str) -> None:
    torch._dynamo.reset()
    reference = _train(plain := _pooling_cnn(), torch.compile(plain, backend=backend), None)
    torch._dynamo.reset()
    model = _pooling_cnn()
    compiled = torch.compile(model, backend=backend)
    target = compiled if spelling.startswith("Controller") else model
    controller = Controller(target, GactConfig.from_level("L1", min_numel=0))
    assert controller.model is model
    with controller, pytest.warns(GactWarning, match="torch.compile") as record:
        weights = _train(model, compiled, controller)
    assert sum(issubclass(w.category, GactWarning) for w in record) == 1
    kinds = {r.kind for r in controller.ledger.last.values()}
    assert Kind.KEPT in kinds and Kind.QUANTIZED not in kinds
    for a, b in zip(weights, reference):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
