"""``rotate`` / ``unrotate``: the spec's bits (reference, CPU and CUDA), the Hadamard matrix,
the inverse, layouts and bad input."""

from __future__ import annotations

import math

import gact_kernels
import pytest
import torch
from gact_kernels.reference import reference_rotate, reference_unrotate
from kernels_testing import DTYPES, bits_equal, requires_cuda

SIZES = [(1000, 256), (3 * 4096 + 5, 4096), (77, 2), (5, 8), (0, 16), (64 * 128, 128)]


def _heavy(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * torch.randn(n, generator=gen).exp() ** 2).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, block", SIZES)
def test_rotate_and_unrotate_are_the_references_bits(dtype: torch.dtype, n: int, block: int):
    x = _heavy(n, dtype)
    y = gact_kernels.rotate(x, block)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert bits_equal(y, reference_rotate(x, block))
    for out in DTYPES:
        back = gact_kernels.unrotate(y, block, dtype=out, seed=7)
        assert bits_equal(back, reference_unrotate(y, block, out, 7))


@pytest.mark.parametrize("block", [2, 8, 16, 128, 256, 1024])
def test_rotation_is_the_signed_sylvester_hadamard_matrix(block: int) -> None:
    """Each block becomes ``H (s * x)`` with ``H`` Sylvester's (``H_2n = [[H, H], [H, -H]]``)
    and ``s`` +-1 (not all equal); the inverse gives ``x`` back to float32 precision."""
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    rows = gact_kernels.rotate(torch.eye(block), block)  # row i: H (s * e_i) = s_i * H[i]
    s = rows[:, 0]  # H[i, 0] = 1
    assert torch.equal(s.abs(), torch.ones(block)) and (block == 2 or s.min() < 0 < s.max())
    assert torch.equal(rows, s[:, None] * h)
    x = torch.randn(5, block)
    y = gact_kernels.rotate(x, block)
    assert torch.allclose(y.double(), x.double() @ rows.double(), atol=1e-4)
    assert torch.allclose(gact_kernels.unrotate(y, block), x, atol=1e-5 * math.log2(block))


def test_rotation_keeps_the_norm_and_spreads_a_spike() -> None:
    x = torch.randn(64, 256)
    y = gact_kernels.rotate(x, 256)
    assert torch.allclose(y.pow(2).sum(1), 256 * x.pow(2).sum(1), rtol=1e-4)
    spike = torch.zeros(256)
    spike[17] = 1.0
    assert torch.equal(gact_kernels.rotate(spike, 256).abs(), torch.ones(256))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_unrotate_rounds_narrow_outputs_stochastically(dtype: torch.dtype) -> None:
    """A float32 value between two neighbours of ``dtype`` comes back as either, up with the
    probability of its distance over their gap, over seeds: 0.25 +- 5 standard errors over
    4,000 draws (false alarm about 6e-7). The block is the identity's: y = B * x in position
    0 of a constant-sign block is restored exactly as float32 before the rounding."""
    lo = torch.tensor(1.0, dtype=dtype)
    hi = torch.nextafter(lo, torch.tensor(2.0, dtype=dtype))
    quarter = float(lo.float() + 0.25 * (hi.float() - lo.float()))
    x = torch.full((2, 1), quarter).expand(2, 2).contiguous().view(-1)[:2]  # a block of 2
    y = gact_kernels.rotate(x, 2)
    assert torch.equal(gact_kernels.unrotate(y, 2), x)
    ups = 0
    for seed in range(4000):
        out = gact_kernels.unrotate(y, 2, dtype=dtype, seed=seed)
        assert bool(((out == lo) | (out == hi)).all())
        ups += int((out == hi).sum())
    assert abs(ups / 8000 - 0.25) < 5 * (0.25 * 0.75 / 8000) ** 0.5


def test_a_dense_layout_is_rotated_in_memory_order() -> None:
    x = _heavy(4 * 8 * 32, torch.float32).view(4, 8, 32).permute(2, 0, 1)  # dense, permuted
    y = gact_kernels.rotate(x, 64)
    assert y.stride() == x.stride()
    flat = x.permute(1, 2, 0).contiguous().view(-1)
    assert bits_equal(y.permute(1, 2, 0).reshape(-1), reference_rotate(flat, 64))
    back = gact_kernels.unrotate(y, 64)
    assert back.stride() == x.stride() and torch.allclose(back, x, rtol=1e-5, atol=1e-4)


def test_non_finite_values_stay_in_their_block() -> None:
    x = torch.randn(3 * 16)
    x[20] = float("inf")
    y = gact_kernels.rotate(x, 16)
    assert bool(torch.isfinite(y[:16]).all()) and bool(torch.isfinite(y[32:]).all())
    assert not bool(torch.isfinite(y[16:32]).any())


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: gact_kernels.rotate(torch.randn(8), 3), ValueError, "power of two"),
        (lambda: gact_kernels.rotate(torch.randn(8), 1), ValueError, "power of two"),
        (lambda: gact_kernels.rotate(torch.randn(8), 8192), ValueError, r"\[2, 4096\]"),
        (lambda: gact_kernels.rotate(torch.randn(8), 8.0), TypeError, "block"),
        (lambda: gact_kernels.rotate(torch.arange(8), 8), ValueError, "dtype"),
        (lambda: gact_kernels.rotate([1.0] * 8, 8), TypeError, "torch.Tensor"),
        (lambda: gact_kernels.unrotate(torch.randn(8).half(), 8), ValueError, "dtype"),
        (lambda: gact_kernels.unrotate(torch.randn(8), 8, dtype=torch.int32), ValueError, "dtype"),
        (lambda: gact_kernels.unrotate(torch.randn(8), 8, seed=-1), ValueError, "seed"),
    ],
)
def test_bad_arguments_raise(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, block", SIZES)
def test_cuda_gives_the_cpu_bits(dtype: torch.dtype, n: int, block: int) -> None:
    x = _heavy(n, dtype)
    y = gact_kernels.rotate(x.cuda(), block)
    assert bits_equal(y.cpu(), gact_kernels.rotate(x, block))
    for out in DTYPES:
        back = gact_kernels.unrotate(y, block, dtype=out, seed=3)
        assert bits_equal(back.cpu(), gact_kernels.unrotate(y.cpu(), block, dtype=out, seed=3))
