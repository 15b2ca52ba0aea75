"""Unbiasedness and variance of the stochastic rounding, checked over many seeds."""

from __future__ import annotations

import math

import gact_kernels
import pytest
import torch
from kernels_testing import requires_cuda

SEEDS = 3000


def _samples(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised samples (SEEDS, n) in float64 and the per-element step."""
    ys = torch.stack(
        [
            gact_kernels.dequantize(gact_kernels.quantize(x, bits, seed=s)).double()
            for s in range(SEEDS)
        ]
    )
    q = gact_kernels.quantize(x, bits)
    step = q.scale.repeat_interleave(q.group_size)[: x.numel()].double().to(x.device)
    return ys.cpu(), step.cpu()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unbiased_and_bernoulli_variance(bits: int, device: str) -> None:
    x = torch.randn(4 * 256 + 100, generator=torch.Generator().manual_seed(bits)).to(device)
    ys, step = _samples(x, bits)
    xd = x.double().cpu()
    # Each sample lies in {lo + floor(v) step, lo + ceil(v) step}, an interval of width `step`,
    # so Hoeffding gives P(|mean - x| >= k step / (2 sqrt(N))) <= 2 exp(-k^2 / 2). With k = 7
    # that is 5e-11 per element, ~6e-8 for the whole test. The 1e-6 step slack absorbs fp32
    # rounding in lo + q * scale.
    k = 7.0
    bound = k * step / (2 * math.sqrt(SEEDS)) + 1e-6 * step
    assert bool(((ys.mean(0) - xd).abs() <= bound).all())
    # Variance: Var = f (1 - f) step^2 with f the fractional part of (x - lo) / step.
    q = gact_kernels.quantize(x, bits)
    lo = q.lo.repeat_interleave(q.group_size)[: x.numel()].double().cpu()
    v = (xd - lo) / step
    f = v - v.floor()
    expected = f * (1 - f) * step**2
    empirical = ys.var(0)
    # Summed over ~1100 elements the relative error of the total is a few 1e-3.
    assert empirical.sum().item() == pytest.approx(expected.sum().item(), rel=0.03)
    assert bool((empirical <= step**2 / 4 * 1.25 + 1e-12).all())


def test_different_seeds_decorrelated() -> None:
    x = torch.rand(20_000)
    a = gact_kernels.dequantize(gact_kernels.quantize(x, 1, seed=0)) - x
    b = gact_kernels.dequantize(gact_kernels.quantize(x, 1, seed=1)) - x
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(corr) < 0.05
