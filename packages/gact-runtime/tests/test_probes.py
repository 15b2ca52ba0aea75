"""Probes leave no trace, and the gradient sketch preserves inner products."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gact.probes import GradientSketch, ProbeGuard
from torch import nn


def _with_grads(model: nn.Module, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    return _flat(model)


def _flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().numpy()


def test_small_models_are_sketched_exactly() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    flat = _with_grads(model, 0)
    model[1].bias.grad = None  # a missing gradient counts as zeros
    flat[-2:] = 0
    sketch = GradientSketch(model, width=1000)
    assert sketch.exact and np.array_equal(sketch(), flat)


@pytest.mark.parametrize("width", [64, 60])  # a power of two (bits as the bucket) or not
def test_the_sketch_is_linear_and_unbiased_for_inner_products(width: int) -> None:
    """Over 400 sketch seeds, the mean of <Sa, Sb> is within 6 standard errors of <a, b>
    (false alarm below 1e-8); the same seed maps every probe identically (linearity); the
    gradients are left as they are."""
    model = nn.Linear(100, 50)  # 5,050 parameters into 64 buckets
    a, b = _with_grads(model, 1), _with_grads(model, 2)
    products = []
    for seed in range(400):
        sketch = GradientSketch(model, width=width, seed=seed)
        _with_grads(model, 1)
        sa = sketch()
        _with_grads(model, 2)
        sb = sketch()
        assert np.array_equal(_flat(model), b)  # not scaled in place
        for p in model.parameters():
            p.grad = p.grad * 3
        assert np.allclose(
            sketch(), 3 * sb, rtol=1e-5, atol=1e-4
        )  # same buckets and signs every call
        products.append(float(sa @ sb))
    assert not GradientSketch(model, width=width).exact and sa.shape == (width,)
    mean, stderr = np.mean(products), np.std(products) / math.sqrt(len(products))
    assert abs(mean - a @ b) <= 6 * stderr
    assert np.std(products) <= math.sqrt(2 / width) * np.linalg.norm(a) * np.linalg.norm(b) * 1.2


def test_probe_guard_sets_gradients_aside_without_copies() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    model(torch.randn(8, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads]
    running = model[1].running_mean.clone()
    model.eval()
    with ProbeGuard(model) as guard:
        assert all(g is None for g in guard._grads[0][2:3])  # no copy of unshared gradients
        for _ in range(2):
            guard.reset_rng()
            guard.clear_grads()
            model.train()
            model(torch.randn(8, 4)).sum().backward()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(g, v) for g, v in zip(grads, values))
    assert torch.equal(model[1].running_mean, running) and not model.training


@pytest.mark.parametrize("zero", ["optimizer", "backbone"])
def test_probes_leave_no_trace_in_what_the_closure_trains_outside_the_model(zero: str) -> None:
    """NOTE [Probes leave no trace]: a closure may train tensors outside the controlled model
    (a head, a learnable loss). Probes set aside and restored only the model's gradients: after
    an adapting ``iterate``, the head's gradient was the last probe's (another dropout mask:
    1.05 off the real step's, relative norm) or, where the closure zeroes only the model's,
    the sum over every run (3.6x its norm). Now the leaves the returned loss was computed from
    are restored too, and the real step's gradient is the one the optimizer sees."""
    from gact import Controller, GactConfig, GactWarning

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 64))
    head = nn.Sequential(nn.Dropout(0.5), nn.Linear(64, 10))  # outside the controlled model
    params = [*backbone.parameters(), *head.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    config = GactConfig.from_level(
        "L2", adapt_first_gap=0, adapt_interval=2, adapt_budget=None, min_numel=0
    )
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    real: list[torch.Tensor] = []

    def closure() -> torch.Tensor:
        (optimizer if zero == "optimizer" else backbone).zero_grad()
        loss = torch.nn.functional.cross_entropy(head(backbone(x)), y)
        loss.backward()
        real.append(head[1].weight.grad.clone())
        return loss

    controller = Controller(backbone, config)
    with controller, pytest.warns(GactWarning, match="outside the controlled model"):
        controller.iterate(closure)
    assert controller.stats()["adaptations"] == 1 and len(real) > 1  # probes ran
    assert torch.equal(head[1].weight.grad, real[0])


def test_probes_restore_numpy_and_python_random_states() -> None:
    """NOTE [Probes leave no trace]: a forward that draws with NumPy or ``random``
    (transformers' SpecAugment in Wav2Vec2 and HuBERT, BigBird's random attention) saw a
    different draw in every probe of an adaptation, and the run after it drew from streams
    the probes had advanced. Now every probe draws the same, as torch's generators make them
    (reset before each), and the streams leave an adaptation where the real step left them."""
    import random

    from gact import Controller, GactConfig

    draws: list[tuple[float, float]] = []

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            draws.append((float(np.random.rand()), random.random()))  # noqa: NPY002
            drawn = np.random.rand(x.shape[0])  # noqa: NPY002
            keep = torch.from_numpy(drawn > 0.3).float()[:, None]
            return self.b(torch.tanh(self.norm(self.a(x * keep))))

    torch.manual_seed(0)
    model = Masked()
    config = GactConfig.from_level("L2", adapt_first_gap=0, adapt_budget=None, min_numel=0)
    controller = Controller(model, config)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))

    def closure() -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        return loss

    np.random.seed(0)  # noqa: NPY002
    random.seed(0)
    with controller:
        controller.iterate(closure)
    after = (float(np.random.rand()), random.random())  # noqa: NPY002
    np.random.seed(0)  # noqa: NPY002
    random.seed(0)
    np.random.rand(65)  # the real step's draws  # noqa: NPY002
    random.random()
    expected_after = (float(np.random.rand()), random.random())  # noqa: NPY002
    assert controller.stats()["adaptations"] == 1 and len(draws) > 2  # probes ran
    assert all(draw == draws[1] for draw in draws[2:])
    assert after == expected_after
