"""Every model family at every level: trains, keeps L1.1 gradients close to fp32, compresses
about 8x at L2, and never compresses a parameter.

Set ``GACT_MATRIX_JSON`` to a file path to record each family's L2 saved-activation ratio and L1.1
gradient cosine there (BENCHMARKS.md's model-family table).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import gact_kernels
import pytest
import torch
from family_models import FAMILIES, Family
from gact import LEVELS, Controller, GactConfig

L2_RATIO = 7.0
L11_COSINE = 0.99
STEPS = 3


def _family(name: str) -> Family:
    family = FAMILIES[name]
    pytest.importorskip(family.requires)
    return family


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.fixture(scope="module")
def figures() -> Iterator[dict[str, dict[str, float]]]:
    """Collects each family's figures; written to $GACT_MATRIX_JSON at the end."""
    found: dict[str, dict[str, float]] = {
        "l2_saved_activation_ratio": {},
        "l11_gradient_cosine": {},
    }
    yield found
    path = os.environ.get("GACT_MATRIX_JSON")
    if path and any(found.values()):
        Path(path).write_text(json.dumps(found, indent=2) + "\n")


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_trains_without_compressing_parameters(
    name: str, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model, loss_fn = _family(name).build()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    quantized_parameters: list[tuple[int, ...]] = []
    quantize = gact_kernels.quantize_async

    def checked_quantize(data: torch.Tensor, *args: object, **kwargs: object) -> object:
        if data.untyped_storage().data_ptr() in storages:
            quantized_parameters.append(tuple(data.shape))
        return quantize(data, *args, **kwargs)

    monkeypatch.setattr(gact_kernels, "quantize_async", checked_quantize)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    controller = Controller(
        model, GactConfig.from_level(level, adapt_interval=2, adapt_first_gap=0, adapt_budget=None)
    )
    losses = []
    with controller:
        for _ in range(STEPS):

            def closure() -> torch.Tensor:
                loss = loss_fn()
                optimizer.zero_grad()
                loss.backward()
                return loss.detach()

            losses.append(float(controller.iterate(closure)))
            optimizer.step()

    assert all(math.isfinite(loss) for loss in losses), losses
    stats = controller.stats()
    assert stats["step"] == STEPS
    assert stats["adaptations"] == (2 if LEVELS[level].adaptive else 0)  # steps 0 and 2
    assert quantized_parameters == []
    assert stats["parameter_saves"] > 0
    assert "<parameters>" in controller.report()
    if LEVELS[level].compresses:
        assert stats["ratio"] > 1.5


@pytest.mark.parametrize("name", list(FAMILIES))
def test_l11_gradient_close_to_fp32(name: str, figures: dict[str, dict[str, float]]) -> None:
    torch.manual_seed(0)
    model, loss_fn = _family(name).build()
    torch.manual_seed(1)  # the same dropout masks in both backwards
    loss_fn().backward()
    reference = _flat_grad(model)
    model.zero_grad()
    with Controller(model, GactConfig.from_level("L1.1")) as controller:
        torch.manual_seed(1)
        loss_fn().backward()
    assert controller.stats()["compressed_tensors"] > 0
    cosine = float(torch.nn.functional.cosine_similarity(_flat_grad(model), reference, dim=0))
    figures["l11_gradient_cosine"][name] = round(cosine, 5)
    assert cosine >= L11_COSINE


@pytest.mark.parametrize("name", list(FAMILIES))
def test_l2_saved_activation_ratio(name: str, figures: dict[str, dict[str, float]]) -> None:
    torch.manual_seed(0)
    model, loss_fn = _family(name).build()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    controller = Controller(model, GactConfig.from_level("L2"))
    with controller:
        for _ in range(2):  # step 0 adapts, step 1 is measured with the adapted bits

            def closure() -> torch.Tensor:
                loss = loss_fn()
                optimizer.zero_grad()
                loss.backward()
                return loss

            controller.iterate(closure)
            optimizer.step()
    ratio = controller.stats()["ratio"]
    figures["l2_saved_activation_ratio"][name] = round(ratio, 3)
    print(f"{name}: L2 saved-activation ratio {ratio:.2f}x")
    assert ratio >= L2_RATIO, controller.report()
