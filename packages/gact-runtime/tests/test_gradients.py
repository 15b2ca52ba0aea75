"""Gradient fidelity: 8 bits is close to fp32, and the compressed gradient is unbiased."""

from __future__ import annotations

import math

import pytest
import torch
from gact import Controller, GactConfig
from models import CASES, make_case
from runtime_helpers import grads_of, make_closure, relative_error, requires_cuda
from torch import nn


@pytest.mark.parametrize("case", CASES)
def test_eight_bits_is_close_to_fp32(case: str) -> None:
    model, x, y = make_case(case)
    closure = make_closure(model, x, y)
    closure()
    reference = grads_of(model)
    errors = {}
    for level in ("L1.1", "L1.2"):
        with Controller(model, GactConfig.from_level(level)) as controller:
            controller.iterate(closure)
        assert controller.stats()["compressed_tensors"] >= 2
        errors[level] = relative_error(grads_of(model), reference)
    assert errors["L1.1"] < 0.02, errors
    assert errors["L1.1"] < errors["L1.2"]  # fewer bits, more noise: the test can tell


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_compressed_gradient_is_unbiased(device: str) -> None:
    """The last layer's weight gradient is linear in its saved input, so E[g] = g exactly.

    For each element, the mean over N seeds must lie within 5 standard errors of the fp32
    gradient (false-alarm probability < 1e-6 per element); the bound uses the empirical spread,
    so a biased rounding (e.g. round-to-nearest) fails it.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)
    x = torch.randn(128, 32, device=device)
    c = torch.randn(128, 8, device=device)

    def closure() -> None:
        model.zero_grad()
        (model(x) * c).sum().backward()

    closure()
    exact = model[2].weight.grad.clone()
    samples = []
    for seed in range(200):
        with Controller(model, GactConfig.from_level("L1.2", min_numel=0, seed=seed)) as ctl:
            ctl.iterate(closure)
        samples.append(model[2].weight.grad.clone())
    stack = torch.stack(samples).double()
    mean, std = stack.mean(0), stack.std(0)
    assert float(std.max()) > 0  # the 2-bit rounding really is random
    stderr = std / math.sqrt(len(samples))
    assert bool(((mean - exact.double()).abs() <= 5 * stderr + 1e-9).all())
    # and the noise shrinks with more bits, as the variance model says
    with Controller(model, GactConfig.from_level("L1.1", min_numel=0, seed=1)) as ctl:
        ctl.iterate(closure)
    err8 = float((model[2].weight.grad - exact).pow(2).mean())
    err2 = float((stack - exact.double()).pow(2).mean())
    assert err8 < err2 / 100
