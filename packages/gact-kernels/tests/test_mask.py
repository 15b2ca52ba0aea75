"""Lossless 1-bit mask packing."""

from __future__ import annotations

import gact_kernels
import pytest
import torch
from kernels_testing import requires_cuda

SHAPES = [(), (0,), (1,), (7,), (8,), (9,), (3, 5, 7), (2, 3, 4, 5, 6), (1000, 33)]


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_exact(shape: tuple, dtype: torch.dtype) -> None:
    mask = (torch.rand(shape) > 0.3).to(dtype)
    p = gact_kernels.pack_mask(mask)
    assert (p.shape, p.dtype, p.device) == (mask.shape, dtype, mask.device)
    assert p.nbytes == (mask.numel() + 7) // 8
    out = gact_kernels.unpack_mask(p)
    assert out.dtype == dtype and out.shape == mask.shape
    assert torch.equal(out, mask)


def test_bit_layout_and_non_contiguous() -> None:
    mask = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert gact_kernels.pack_mask(mask).data.tolist() == [0x81, 0x01]
    m = torch.rand(64, 65) > 0.5
    for view in (m.t(), m[:, ::2], m[1:, 3:]):
        assert torch.equal(gact_kernels.unpack_mask(gact_kernels.pack_mask(view)), view)


def test_large_mask_multithreaded() -> None:
    mask = torch.rand(1_000_003) > 0.5
    p = gact_kernels.pack_mask(mask)
    assert torch.equal(gact_kernels.unpack_mask(p.to("cpu")), mask)
    assert len(p.buffers()) == 1


def test_uint8_values_above_one_rejected_on_cpu() -> None:
    with pytest.raises(ValueError, match="only 0 and 1"):
        gact_kernels.pack_mask(torch.tensor([0, 1, 2], dtype=torch.uint8))


@requires_cuda
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_matches_cpu(shape: tuple) -> None:
    mask = torch.rand(shape) > 0.5
    cpu, gpu = gact_kernels.pack_mask(mask), gact_kernels.pack_mask(mask.cuda())
    assert gpu.device.type == "cuda"
    assert torch.equal(cpu.data, gpu.data.cpu())
    out = gact_kernels.unpack_mask(gpu)
    assert out.device.type == "cuda" and torch.equal(out.cpu(), mask)
    assert torch.equal(gact_kernels.unpack_mask(cpu.to("cuda")).cpu(), mask)
    u8 = mask.to(torch.uint8).cuda()[1:] if mask.dim() == 1 and mask.numel() > 1 else None
    if u8 is not None:  # unaligned start on the device
        assert torch.equal(gact_kernels.unpack_mask(gact_kernels.pack_mask(u8)), u8)
