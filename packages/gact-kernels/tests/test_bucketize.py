"""``bucketize``: torch.bucketize's codes, exactly, as uint8, in the input's layout."""

from __future__ import annotations

import gact_kernels
import pytest
import torch
from kernels_testing import DTYPES, requires_cuda


def _boundaries(count: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    values = torch.randn(count, generator=gen).sort().values.to(dtype)
    if count > 3:
        values[2] = values[1]  # a repeated boundary: an empty interval
    return values


def _special(x: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN, infinities, signed zeros and values equal to boundaries mixed in."""
    flat = x.reshape(-1)
    n = flat.numel()
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0]
    specials += boundaries.float().tolist()[:8]
    for i, v in enumerate(specials):
        if i * 37 < n:
            flat[i * 37] = v
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("count", [0, 1, 15, 255])
@pytest.mark.parametrize("shape", [(0,), (1,), (3000,), (5, 7, 300)], ids=str)
def test_matches_torch_bucketize(dtype: torch.dtype, count: int, shape: tuple) -> None:
    gen = torch.Generator().manual_seed(count * 7 + len(shape))
    boundaries = _boundaries(count, dtype, gen)
    x = _special((torch.randn(shape, generator=gen) * 1.5).to(dtype), boundaries)
    codes = gact_kernels.bucketize(x, boundaries)
    assert codes.dtype is torch.uint8 and codes.shape == x.shape
    expected = torch.bucketize(x, boundaries)
    assert torch.equal(codes.long(), expected)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.transpose(0, 2),  # dense, permuted: read in place
        lambda t: t.to(memory_format=torch.channels_last),
        lambda t: t[:, ::2],  # gaps: copied contiguous
        lambda t: t[:1].expand(4, -1, -1, -1),  # overlapping
    ],
    ids=["permuted", "channels_last", "strided", "expanded"],
)
def test_layouts(make) -> None:
    gen = torch.Generator().manual_seed(3)
    x = make(torch.randn(4, 6, 5, 9, generator=gen))
    boundaries = torch.linspace(-1.5, 1.5, 9)
    codes = gact_kernels.bucketize(x, boundaries)
    assert torch.equal(codes.long(), torch.bucketize(x.contiguous(), boundaries))
    if x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last):
        assert codes.stride() == x.stride()


def test_threads_do_not_change_codes() -> None:
    x = torch.randn(1 << 17, generator=torch.Generator().manual_seed(0))
    boundaries = torch.linspace(-2, 2, 15)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gact_kernels.bucketize(x, boundaries)
        torch.set_num_threads(2)
        two = gact_kernels.bucketize(x, boundaries)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(one.long(), torch.bucketize(x, boundaries))


@pytest.mark.parametrize(
    ("x", "boundaries", "error", "match"),
    [
        (torch.ones(3), [0.0], TypeError, "boundaries must be a torch.Tensor"),
        ([1.0], torch.zeros(1), TypeError, "x must be a torch.Tensor"),
        (torch.ones(3, dtype=torch.int32), torch.zeros(1), ValueError, "dtype torch.int32"),
        (torch.ones(3), torch.zeros(2, 2), ValueError, "must be 1-D"),
        (torch.ones(3), torch.zeros(256), ValueError, "at most 255"),
        (torch.ones(3), torch.zeros(2, dtype=torch.float64), ValueError, "x's dtype"),
        (torch.ones(3).half(), torch.zeros(2), ValueError, "boundaries.to"),
    ],
)
def test_errors(x: object, boundaries: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        gact_kernels.bucketize(x, boundaries)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    boundaries = _boundaries(15, dtype, gen)
    x = _special(torch.randn(70_000, generator=gen).to(dtype), boundaries)
    cpu = gact_kernels.bucketize(x, boundaries)
    gpu = gact_kernels.bucketize(x.cuda(), boundaries.cuda())
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
