"""Unbiasedness and variance of the round trip, checked over many samples."""

from __future__ import annotations

import math
from collections.abc import Callable

import gact_kernels
import pytest
import torch
from gact_kernels.reference import round_stochastic
from kernels_testing import DTYPES, requires_cuda

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
    # Independent streams: corr ~ N(0, 1/20000), so 0.05 is 7 standard deviations (p < 3e-12).
    assert abs(corr) < 0.05


GROUP = 64
COPIES = 8192  # samples per element
DELTA = 1e-9  # false-alarm probability per element


def _draws(
    gen: torch.Generator,
) -> tuple[Callable[[float, float], torch.Tensor], Callable[[float, int], torch.Tensor]]:
    """``uniform(a, b)``: GROUP float64 draws in [a, b); ``steps(unit, count)``: GROUP random
    multiples ``0 .. count-1`` of ``unit``; both from ``gen``."""

    def uniform(a: float, b: float) -> torch.Tensor:
        return a + (b - a) * torch.rand(GROUP, generator=gen, dtype=torch.float64)

    def steps(unit: float, count: int) -> torch.Tensor:
        return unit * torch.randint(0, count, (GROUP,), generator=gen).double()

    return uniform, steps


def hard_groups(dtype: torch.dtype) -> torch.Tensor:
    """Groups of GROUP elements where rounding is hardest to keep unbiased, in ``dtype``."""
    fi = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(7)
    uniform, steps = _draws(gen)

    parts = [
        uniform(0, 2),  # the reported case: the level grid is finer than bf16's near 1
        uniform(-3, 5),
        512 + steps(fi.eps * 512, 9),  # range of 8 output units: the step is below the grid
        uniform(fi.max / 2, fi.max),  # levels can round past the largest finite value
        uniform(-fi.max, -fi.max / 2),
        steps(fi.tiny * fi.eps, 40),  # a range of a few subnormals
        uniform(0, 4 * fi.tiny),  # across the smallest normal
        uniform(-1e-3, 1e-3),  # levels near 0 (cancellation in lo + q * scale)
    ]
    return torch.cat(parts).to(dtype)


def float32_slack(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound on |E[round trip] - x| from the quantiser's and the level's fp32 arithmetic.

    Per element, (x - lo), its division by the step, the addition of the 24-bit noise, the
    clamp to 2^b - 1 and lo + q * scale add at most ~15 units of 2^-24 relative to the group's
    largest magnitude M (exact enumeration over all 2^24 noise values measures <= 1.7 ulp(M));
    subnormal results add absolute errors of 2^-150 per operation; float16 outputs of levels
    below 2^-33 may be short of an up-probability of 2^-32 (NOTE [storage and RNG invariants]).
    """
    magnitude = x.double().abs().view(-1, GROUP).amax(1).repeat_interleave(GROUP)
    absolute = 2.0**-56 if dtype == torch.float16 else 2.0**-147
    return 16 * 2.0**-24 * magnitude + absolute


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", range(1, 9))
def test_round_trip_unbiased_in_output_dtype(bits: int, dtype: torch.dtype) -> None:
    """E[dequantize(quantize(x))] = x for every width and dtype, on hard groups.

    COPIES copies of the groups are quantised in one call; copy r of element i sits at index
    i + r * n, so its noise (and its output rounding) comes from a different counter of the
    stream. Each sample lies in [level_k - unit, level_{k+1} + unit], `unit` the spacing of the
    output grid there (0 for float32, which rounds to nearest), so Hoeffding gives
    P(|mean - E| >= R sqrt(ln(2/DELTA) / (2 N))) <= DELTA with R = step + 2 unit: with
    DELTA = 1e-9 per element the false-alarm probability of all 24 cases is below 1.2e-5.
    """
    x = hard_groups(dtype)
    n = x.numel()
    q = gact_kernels.quantize(x.repeat(COPIES), bits, group_size=GROUP, seed=1000 * bits + 1)
    y = gact_kernels.dequantize(q).view(COPIES, n)
    assert y.dtype == dtype
    mean = y.double().mean(0)
    xd = x.double()
    step = q.scale[: n // GROUP].double().repeat_interleave(GROUP)
    lossless = torch.isnan(step)
    assert bool((y[:, lossless] == x[lossless]).all())  # tiny-range groups come back exactly
    fi = torch.finfo(dtype)
    if dtype == torch.float32:
        unit = torch.zeros_like(xd)
    else:  # the output grid's spacing at the largest level the element can take
        top = (xd.abs() + step).clamp(min=fi.tiny)
        unit = fi.eps * torch.exp2(torch.floor(torch.log2(top)))
    spread = step + 2 * unit + 2 * float32_slack(x, dtype)
    hoeffding = spread * math.sqrt(math.log(2 / DELTA) / (2 * COPIES))
    bound = hoeffding + float32_slack(x, dtype)
    err = (mean - xd).abs()
    coded = ~lossless
    worst = int(torch.argmax(torch.where(coded, err - bound, -math.inf)))
    assert bool((err[coded] <= bound[coded]).all()), (worst, float(xd[worst]), float(err[worst]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_stochastic_rounding_exact_expectation(dtype: torch.dtype) -> None:
    """The output rounding rule (NOTE [storage and RNG invariants]) averaged over every value
    of the random bits it reads is exactly the level (no sampling, so no false alarms)."""
    fi = torch.finfo(dtype)
    sub = fi.tiny * fi.eps
    v = torch.tensor(
        [1.00390625, 1.0 + 2**-20, -3.3e-3, 511.99, fi.tiny * 1.5, fi.tiny * 0.75, sub * 2.5,
         sub * 0.25, 2.0**-33 * 3, fi.max * 0.99, -fi.max * 0.999, 0.0],
        dtype=torch.float64,
    ).float()  # fmt: skip
    high16 = torch.arange(2**16, dtype=torch.int64) << 16  # every value of h's 16 high bits
    if dtype == torch.float16:
        # Normal halves read h's 13 high bits. Subnormal ones compare all 32 bits with the
        # discarded fraction F; where F is a multiple of 2^16 (checked) the 16 high bits decide.
        subnormal = v.abs() < fi.tiny
        assert bool(((v[subnormal].abs() * 2.0**40).frac() == 0).all())
    means = [round_stochastic(value.expand(2**16), high16, dtype).double().mean() for value in v]
    assert torch.equal(torch.stack(means), v.double())


def test_stochastic_rounding_never_overflows() -> None:
    h = torch.tensor([0, 2**32 - 1])
    for dtype in (torch.float16, torch.bfloat16):
        fi = torch.finfo(dtype)
        above = torch.tensor([fi.max * (1 + fi.eps / 4), torch.finfo(torch.float32).max])
        for v in above:
            out = round_stochastic(v.expand(2), h, dtype)
            assert out.tolist() == [fi.max, fi.max]
            assert (-out).tolist() == round_stochastic(-v.expand(2), h, dtype).tolist()


def zero_minimum_groups(dtype: torch.dtype) -> torch.Tensor:
    """Groups of GROUP elements, about half of them zeros (element 0 always), so that every
    group's minimum is 0 and ``zero_exact=True`` gives it the sign-exact grid; in ``dtype``."""
    fi = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(11)
    uniform, steps = _draws(gen)

    parts = [
        uniform(0, 2),
        torch.randn(GROUP, generator=gen, dtype=torch.float64).abs(),  # ReLU of N(0, 1)
        512 + steps(fi.eps * 512, 9),  # the step is below the output grid
        uniform(fi.max / 2, fi.max),  # levels can round past the largest finite value
        uniform(0, 600 * fi.tiny),  # levels next to tiny (coded at every width)
        uniform(0, 1e-3),
        uniform(0, fi.tiny),  # all below tiny: lossless for fp32/bf16, a step of 0 for fp16
    ]
    x = torch.cat(parts).view(-1, GROUP)
    zeros = torch.rand(x.shape, generator=gen) < 0.5
    zeros[:, 0] = True
    return x.masked_fill(zeros, 0.0).flatten().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", range(2, 9))
def test_zero_exact_round_trip_unbiased(bits: int, dtype: torch.dtype) -> None:
    """``zero_exact=True``: zeros come back exactly 0, positives below tiny exactly tiny (a
    bias in (0, tiny)), positives >= tiny unbiased in the output dtype; fp32 variance is
    f (1 - f) step^2 with f the fractional part of (x - tiny) / step.

    Same sampling as test_round_trip_unbiased_in_output_dtype (COPIES copies in one call,
    Hoeffding with DELTA = 1e-9 per element): the false-alarm probability of all 21 cases is
    below 1e-5. The variance sum's relative sampling error is a few 1e-3.
    """
    x = zero_minimum_groups(dtype)
    n, tiny = x.numel(), torch.finfo(dtype).tiny
    q = gact_kernels.quantize(
        x.repeat(COPIES), bits, group_size=GROUP, seed=1000 * bits + 2, zero_exact=True
    )
    y = gact_kernels.dequantize(q).view(COPIES, n)
    groups = n // GROUP
    assert q.lo[:groups].view(torch.int32).eq(0).all()  # every minimum is +0
    step = q.scale[:groups].double().repeat_interleave(GROUP)
    lossless = torch.isnan(step)
    assert bool((y[:, lossless] == x[lossless]).all())
    assert bool((y[:, x == 0] == 0).all())
    below = ~lossless & (x > 0) & (x < tiny)
    assert bool((y[:, below] == tiny).all())
    above = ~lossless & (x >= tiny)
    assert int(above.sum()) > 5 * GROUP / 2
    xd, mean = x.double(), y.double().mean(0)
    fi = torch.finfo(dtype)
    if dtype == torch.float32:
        unit = torch.zeros_like(xd)
    else:
        top = (xd.abs() + step).clamp(min=fi.tiny)
        unit = fi.eps * torch.exp2(torch.floor(torch.log2(top)))
    spread = step + 2 * unit + 2 * float32_slack(x, dtype)
    bound = spread * math.sqrt(math.log(2 / DELTA) / (2 * COPIES)) + float32_slack(x, dtype)
    err = (mean - xd).abs()
    worst = int(torch.argmax(torch.where(above, err - bound, -math.inf)))
    assert bool((err[above] <= bound[above]).all()), (worst, float(xd[worst]), float(err[worst]))
    if dtype == torch.float32:
        v = (xd - tiny) / step
        f = v - v.floor()
        expected = (f * (1 - f) * step**2)[above].sum().item()
        assert y.double().var(0)[above].sum().item() == pytest.approx(expected, rel=0.03)
