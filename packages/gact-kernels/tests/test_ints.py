"""Lossless integer packing: exact round trips, the byte format and agreement with the reference."""

from __future__ import annotations

import math

import gact_kernels
import pytest
import torch
import torch.nn.functional as F
from gact_kernels.reference import reference_pack_ints, reference_unpack_ints
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testing import bits_equal, requires_cuda

INT_DTYPES = gact_kernels.INT_DTYPES
I64 = torch.iinfo(torch.int64)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    info = torch.iinfo(dtype)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, shape, dtype=dtype, generator=gen)


def _expected_nbytes(x: torch.Tensor, group_size: int) -> int:
    flat = x.reshape(-1).long()
    total = 0
    for g in range(math.ceil(flat.numel() / group_size)):
        part = flat[g * group_size : (g + 1) * group_size].tolist()
        width = (max(part) - min(part)).bit_length()
        total += math.ceil(len(part) * width / 8) + 9  # codes + int64 minimum + uint8 width
    return total


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (8,), (255,), (257,), (3, 5, 7), (2, 300)])
def test_round_trip_exact_and_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = _random(dtype, shape)
    p = gact_kernels.pack_ints(x)
    assert (p.shape, p.dtype, p.device, p.group_size) == (x.shape, dtype, x.device, 256)
    y = gact_kernels.unpack_ints(p)
    assert y.dtype == dtype and bits_equal(y, x)
    assert p.nbytes == _expected_nbytes(x, 256)


@pytest.mark.parametrize("group_size", [8, 16, 64, 256, 1000])
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_matches_reference_bytes(dtype: torch.dtype, group_size: int) -> None:
    x = _random(dtype, (5 * group_size + 13,), seed=group_size)
    x[: group_size // 2] //= 1000  # groups of different widths
    x[group_size : 2 * group_size] = 7  # a constant group
    p = gact_kernels.pack_ints(x, group_size=group_size)
    assert p == reference_pack_ints(x, group_size=group_size)
    assert bits_equal(reference_unpack_ints(p), x)
    assert bits_equal(gact_kernels.unpack_ints(p), x)


def test_byte_layout() -> None:
    # group 0: min 5, codes 0..7 in 3 bits = 3 bytes; group 1 (partial): constant -> 0 bytes
    x = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, -4, -4], dtype=torch.int64)
    p = gact_kernels.pack_ints(x, group_size=8)
    assert p.mins.tolist() == [5, -4] and p.widths.tolist() == [3, 0]
    assert p.data.tolist() == [0b10_001_000, 0b1_100_011_0, 0b111_110_10]
    assert p.nbytes == 3 + 16 + 2


def test_full_int64_range() -> None:
    x = torch.tensor([I64.min, I64.max, 0, -1, 1, I64.min + 1, I64.max - 1, 12345] * 3)
    p = gact_kernels.pack_ints(x, group_size=8)
    assert p.widths.tolist() == [64, 64, 64] and p.mins.tolist() == [I64.min] * 3
    assert p.data.numel() == 3 * 64
    assert torch.equal(gact_kernels.unpack_ints(p), x)
    assert p == reference_pack_ints(x, group_size=8)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_extremes_and_widths(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    x = torch.tensor([info.min, info.max] + [info.min] * 6 + [info.max] * 8, dtype=dtype)
    p = gact_kernels.pack_ints(x, group_size=8)
    assert p.widths.tolist() == [info.bits, 0]
    assert p.mins.tolist() == [info.min, info.max]
    assert torch.equal(gact_kernels.unpack_ints(p), x)


def test_every_width_0_to_64() -> None:
    groups = [torch.zeros(8, dtype=torch.int64)]
    for w in range(1, 64):
        groups.append(torch.tensor([-(2 ** (w - 1))] * 4 + [2 ** (w - 1) - 1] * 4))
    groups.append(torch.tensor([I64.min, I64.max] * 4))
    x = torch.cat(groups)  # group g holds a range of exactly g bits
    p = gact_kernels.pack_ints(x, group_size=8)
    assert p.widths.tolist() == list(range(65))
    assert p.data.numel() == sum(range(65))
    assert torch.equal(gact_kernels.unpack_ints(p), x)
    assert p == reference_pack_ints(x, group_size=8)


def test_max_pool_indices_shrink() -> None:
    x = torch.randn(2, 16, 56, 56)
    _, idx = F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True)
    p = gact_kernels.pack_ints(idx)
    assert torch.equal(gact_kernels.unpack_ints(p), idx)
    assert idx.nbytes / p.nbytes > 5  # <= 11 bits of 64 per index, 9 bytes per group


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=4),
    group_size=st.sampled_from([8, 16, 24, 256]),
    dtype=st.sampled_from(INT_DTYPES),
    spread=st.integers(0, 64),
)
def test_property_matches_reference(shape, group_size, dtype, spread) -> None:
    x = _random(torch.int64, tuple(shape)) >> (64 - spread) if spread else torch.zeros(shape)
    info = torch.iinfo(dtype)
    x = x.long().clamp(info.min, info.max).to(dtype)
    p = gact_kernels.pack_ints(x, group_size=group_size)
    assert p == reference_pack_ints(x, group_size=group_size)
    assert bits_equal(gact_kernels.unpack_ints(p), x)


def test_wrong_arguments() -> None:
    with pytest.raises(ValueError, match=r"x: dtype torch\.float32 is not supported; accepted: ui"):
        gact_kernels.pack_ints(torch.ones(3))
    with pytest.raises(ValueError, match="group_size must be a multiple of 8"):
        gact_kernels.pack_ints(torch.ones(3, dtype=torch.int64), group_size=12)
    with pytest.raises(TypeError, match="p must be a PackedInts, got PackedMask"):
        gact_kernels.unpack_ints(gact_kernels.pack_mask(torch.ones(3, dtype=torch.bool)))


@requires_cuda
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_cuda_matches_cpu_bytes(dtype: torch.dtype) -> None:
    for group_size in (8, 256, 4096):
        x = _random(dtype, (3, 7, 1001), seed=group_size)
        x[0, :2] //= 100
        x[1] = 3
        cpu = gact_kernels.pack_ints(x, group_size=group_size)
        gpu = gact_kernels.pack_ints(x.cuda(), group_size=group_size)
        assert gpu.device.type == "cuda" and gpu.to("cpu") == cpu
        y = gact_kernels.unpack_ints(gpu)
        assert y.device.type == "cuda" and bits_equal(y, x)
        assert bits_equal(gact_kernels.unpack_ints(cpu.to("cuda")), x)


@requires_cuda
def test_cuda_layouts_and_int64_extremes() -> None:
    x = torch.tensor([I64.min, I64.max, -1, 0] * 100, device="cuda").view(20, 20).t()
    p = gact_kernels.pack_ints(x, group_size=8)
    y = gact_kernels.unpack_ints(p)
    assert y.stride() == x.stride() and torch.equal(y, x)
    cl = torch.randint(0, 3000, (2, 8, 5, 5), device="cuda").contiguous(
        memory_format=torch.channels_last
    )
    back = gact_kernels.unpack_ints(gact_kernels.pack_ints(cl))
    assert back.stride() == cl.stride() and torch.equal(back, cl)
