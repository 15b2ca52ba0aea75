"""Round trips, exactness guarantees, storage size and agreement with the torch reference."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import gact_kernels
import pytest
import torch
from gact_kernels.reference import reference_dequantize, reference_quantize
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testing import (
    DTYPES,
    PACKING_PATHS,
    assert_within_one_step,
    bits_equal,
    expected_nbytes,
    packing_path,
    requires_cuda,
    requires_vbmi,
)

SHAPES = [(), (0,), (0, 5), (1,), (7,), (255,), (256,), (257,), (3, 5, 7), (2, 3, 4, 5, 6)]


def assert_same(a: gact_kernels.QuantizedTensor, b: gact_kernels.QuantizedTensor) -> None:
    """Equal containers (buffers bit for bit, on any devices)."""
    assert a.to("cpu") == b.to("cpu"), (a, b)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", range(1, 9))
def test_round_trip_within_one_step(bits: int, dtype: torch.dtype, shape: tuple) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(bits)) * 3).to(dtype)
    q = gact_kernels.quantize(x, bits, seed=bits)
    assert (q.bits, q.shape, q.dtype, q.device, q.group_size) == (
        bits,
        x.shape,
        dtype,
        x.device,
        256,
    )
    assert q.numel == x.numel()
    assert q.nbytes == expected_nbytes(x.numel(), bits, 256, 0, x.element_size())
    assert_within_one_step(x, q)


@pytest.mark.parametrize("path", PACKING_PATHS)
@pytest.mark.parametrize("group_size", [8, 64, 256, 1000, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", range(1, 9))
def test_matches_reference_bytes(bits: int, dtype: torch.dtype, group_size: int, path: str) -> None:
    x = torch.randn(5 * group_size + 13, dtype=torch.float32).mul_(10).to(dtype)
    r = reference_quantize(x, bits, group_size=group_size, seed=12345)
    with packing_path(path):
        q = gact_kernels.quantize(x, bits, group_size=group_size, seed=12345)
        assert_same(q, r)
        y = gact_kernels.dequantize(q)
        assert bits_equal(y, reference_dequantize(r))
        assert_within_one_step(x, q)


@requires_vbmi
@settings(max_examples=80, deadline=None)
@given(
    numel=st.integers(1, 2100),
    bits=st.integers(1, 8),
    group_size=st.sampled_from([8, 16, 24, 40, 64, 256, 1000]),
    channels=st.sampled_from([None, 1, 3, 8]),
    seed=st.integers(0, 2**64 - 1),
)
def test_packing_paths_agree(numel, bits, group_size, channels, seed) -> None:
    """Both packing paths write the same bytes and read each other's, tails (a last group of
    any length, a last chunk of fewer than 8 codes) and channel runs included."""
    if channels is None:
        x, channel_dim = torch.randn(numel), None
    else:  # NCHW and channels-last maps, read as channel runs
        x, channel_dim = torch.randn(2, channels, numel // (2 * channels) + 1, 3), 1
        if seed % 2:
            x = x.contiguous(memory_format=torch.channels_last)
    kw = dict(group_size=group_size, seed=seed, channel_dim=channel_dim)
    out = {}
    for path in PACKING_PATHS:
        with packing_path(path):
            q = gact_kernels.quantize(x, bits, **kw)
            out[path] = q, gact_kernels.dequantize(q)
    (qv, yv), (qp, yp) = out["vbmi"], out["portable"]
    assert_same(qv, qp)
    assert bits_equal(yv, yp)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=5),
    bits=st.integers(1, 8),
    group_size=st.sampled_from([8, 16, 32, 40, 256, 512]),
    seed=st.integers(0, 2**64 - 1),
    dtype=st.sampled_from(DTYPES),
)
def test_property_matches_reference(shape, bits, group_size, seed, dtype) -> None:
    x = torch.randn(shape).mul_(100).to(dtype)
    q = gact_kernels.quantize(x, bits, group_size=group_size, seed=seed)
    assert_same(q, reference_quantize(x, bits, group_size=group_size, seed=seed))
    assert bits_equal(gact_kernels.dequantize(q), reference_dequantize(q))
    assert_within_one_step(x, q)


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b.t(),
        lambda b: b[:, ::3],
        lambda b: b[5:, 2:-1],
        lambda b: b[:, None].expand(300, 2, 301),
    ],
    ids=["transposed", "strided", "sliced", "expanded"],
)
def test_non_contiguous_inputs(make) -> None:
    x = make(torch.randn(300, 301))
    assert not x.is_contiguous()
    q = gact_kernels.quantize(x, 3, seed=5)
    if q.stride == x.stride():  # dense (transposed): read in memory order, strides restored
        assert_same(q, gact_kernels.quantize(x.t().contiguous().t(), 3, seed=5))
    else:  # gaps or overlaps: copied contiguous first
        assert_same(q, gact_kernels.quantize(x.contiguous(), 3, seed=5))
    assert_within_one_step(x, q)


def test_deterministic_across_calls_and_seeds() -> None:
    x = torch.randn(10_000)
    a, b = gact_kernels.quantize(x, 2, seed=99), gact_kernels.quantize(x, 2, seed=99)
    assert_same(a, b)
    assert not torch.equal(a.data, gact_kernels.quantize(x, 2, seed=100).data)


_HASH_SCRIPT = """
import hashlib, torch, gact_kernels
torch.set_num_threads({threads})
x = torch.randn(300_000, generator=torch.Generator().manual_seed(0)).to(torch.{dtype})
q = gact_kernels.quantize(x, {bits}, seed=2**63 + 7)
h = hashlib.sha256()
for t in (q.data, q.lo, q.scale):
    h.update(t.numpy().tobytes())
print(torch.get_num_threads(), h.hexdigest())
"""


@pytest.mark.parametrize("bits,dtype", [(3, "bfloat16"), (8, "float32")])
def test_deterministic_across_thread_counts(bits: int, dtype: str) -> None:
    digests = set()
    for threads in ("1", "2", "5"):
        env = dict(os.environ, OMP_NUM_THREADS=threads)
        out = subprocess.run(
            [sys.executable, "-c", _HASH_SCRIPT.format(bits=bits, dtype=dtype, threads=threads)],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        used, digest = out.stdout.split()
        assert used == threads
        digests.add(digest)
    assert len(digests) == 1
    x = torch.randn(100_000)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gact_kernels.quantize(x, 5, seed=3)
        torch.set_num_threads(3)
        assert_same(one, gact_kernels.quantize(x, 5, seed=3))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [1, 3, 8])
def test_constant_groups_exact(bits: int, dtype: torch.dtype) -> None:
    x = torch.cat([torch.full((256,), 3.140625), torch.zeros(256), torch.full((100,), -7.5)])
    x = x.to(dtype)
    q = gact_kernels.quantize(x, bits, seed=1)
    assert torch.equal(q.scale, torch.zeros(3))
    assert torch.equal(gact_kernels.dequantize(q), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [1, 4, 5])
def test_lossless_groups_lossless(bits: int, dtype: torch.dtype) -> None:
    x = torch.randn(4 * 256 + 77).to(dtype)
    x[3] = float("nan")
    x[256 + 10] = float("inf")
    x[2 * 256 + 5] = float("-inf")
    x[-1] = float("nan")
    x[-2] = float("inf")
    q = gact_kernels.quantize(x, bits, seed=4)
    assert q.lossless_groups.tolist() == [0, 1, 2, 4]
    assert torch.isnan(q.scale).tolist() == [True, True, True, False, True]
    assert q.nbytes == expected_nbytes(x.numel(), bits, 256, 4, x.element_size())
    y = gact_kernels.dequantize(q)
    assert bits_equal(y[:768], x[:768]) and bits_equal(y[1024:], x[1024:])
    assert_within_one_step(x, q)
    assert_same(q, reference_quantize(x, bits, seed=4))


def test_half_rounding_of_tiny_levels_matches_reference() -> None:
    """fp16 outputs of levels on every fp32 exponent from 2^-61 to 2^-14 (the subnormal half
    grid, where the kernels round with integer shifts of the mantissa, left above 2^-33 and
    right below): the same bits as the reference, with enough of the smallest rounded up to
    say that those shifts ran."""
    x = torch.zeros(1 << 20, dtype=torch.float16)
    q = gact_kernels.quantize(x, 8, seed=7)
    groups = q.lo.numel()  # levels q * scale, q = 0..255, scales 2^-61 .. 2^-22
    scale = torch.exp2(-torch.linspace(61.0, 22.0, groups))
    q = dataclasses.replace(q, lo=torch.zeros(groups), scale=scale)
    q = dataclasses.replace(q, data=torch.arange(q.data.numel()).to(torch.uint8))
    y, r = gact_kernels.dequantize(q), reference_dequantize(q)
    assert bits_equal(y, r)
    # Below 2^-33 (the right shifts) a level goes up with probability |v| * 2^24 < 2^-9: 75
    # expected here, and fewer than 25 has a Poisson probability below 1e-10.
    levels = q.data.float() * scale.repeat_interleave(256)
    assert ((y != 0) & (levels < 2.0**-33)).sum() >= 25


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_signed_zeros_and_extremes_match_reference(dtype: torch.dtype) -> None:
    fmax = torch.finfo(dtype).max
    groups = [
        [-0.0, 0.0, 1.0, 2.0, -0.0, 0.5, 0.0, 3.0],  # min is a zero of either sign
        [-1.0, -0.0, -2.0, -0.0, -3.0, -0.5, -1.5, -0.0],  # max is -0
        [-0.0] * 8,  # constant
        [fmax, -fmax, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],  # range overflows for float32
        [1e-38, 2e-38, 0.0, 3e-38, 5e-39, 1e-39, 0.0, 4e-38],  # subnormal steps
    ]
    x = torch.tensor(groups).to(dtype).flatten()
    for bits in (1, 4, 8):
        q = gact_kernels.quantize(x, bits, group_size=8, seed=3)
        assert_same(q, reference_quantize(x, bits, group_size=8, seed=3))
        assert_within_one_step(x, q)


def test_overflowing_range_is_lossless() -> None:
    x = torch.tensor([-3e38, 3e38] * 8)
    q = gact_kernels.quantize(x, 4, group_size=8)
    assert q.lossless_groups.tolist() == [0, 1]
    assert torch.equal(gact_kernels.dequantize(q), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_subnormal_ranges_are_lossless(dtype: torch.dtype) -> None:
    tiny = torch.finfo(dtype).tiny
    sub = tiny * torch.finfo(dtype).eps
    x = torch.cat([torch.arange(8) * sub, torch.linspace(0, 4 * tiny, 8), torch.arange(8.0)])
    x = x.to(dtype)
    for bits in range(1, 9):
        q = gact_kernels.quantize(x, bits, group_size=8)
        # the step (range / (2^b - 1)) of the first two groups would be subnormal: stored exactly
        expected = [0] + ([1] if 4 * tiny / (2**bits - 1) < 2.0**-126 else [])
        assert q.lossless_groups.tolist() == expected, bits
        assert bool(q.scale[2] > 0)
        assert torch.equal(gact_kernels.dequantize(q)[:8], x[:8])
        assert_same(q, reference_quantize(x, bits, group_size=8))


@pytest.mark.parametrize("bits", range(1, 9))
def test_levels_never_overflow_to_inf(bits: int) -> None:
    fmax = torch.finfo(torch.float32).max
    x = torch.rand(4096, generator=torch.Generator().manual_seed(bits)) * fmax
    x[::256] = fmax
    x[1::256] = 0.0
    for seed in range(4):
        y = gact_kernels.dequantize(gact_kernels.quantize(x, bits, seed=seed))
        assert bool(torch.isfinite(y).all())
    xb = x.bfloat16().clamp(max=torch.finfo(torch.bfloat16).max)
    assert bool(torch.isfinite(gact_kernels.dequantize(gact_kernels.quantize(xb, bits))).all())


def test_nbytes_formula_default_group() -> None:
    q = gact_kernels.quantize(torch.randn(1000, 7), 3)
    assert q.nbytes == math.ceil(7000 * 3 / 8) + 8 * math.ceil(7000 / 256)
    assert q.data.numel() == 2625 and q.lo.numel() == q.scale.numel() == 28


def test_frozen_to_and_buffers() -> None:
    x = torch.randn(3, 1000)
    q = gact_kernels.quantize(x, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.bits = 2
    moved = q.to("cpu", non_blocking=True)
    assert_same(q, moved)
    assert len(q.buffers()) == 5 and all(isinstance(t, torch.Tensor) for t in q.buffers())
    with pytest.raises(ValueError, match="pin_memory=True needs device='cpu'"):
        q.to("cuda", pin_memory=True)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", range(1, 9))
def test_cuda_matches_cpu_bytes(bits: int, dtype: torch.dtype) -> None:
    x = torch.randn(3, 7, 1001).mul_(5).to(dtype)
    x[0, 0, 0] = float("nan")
    x[2, 6, -1] = float("-inf")
    for group_size in (8, 256, 4096):
        cpu = gact_kernels.quantize(x, bits, group_size=group_size, seed=2**64 - 1)
        gpu = gact_kernels.quantize(x.cuda(), bits, group_size=group_size, seed=2**64 - 1)
        assert gpu.device.type == "cuda"
        assert_same(cpu, gpu)
        y_gpu = gact_kernels.dequantize(gpu)
        assert y_gpu.device.type == "cuda"
        y_cpu = gact_kernels.dequantize(cpu)
        assert bits_equal(y_gpu, y_cpu)
        assert bits_equal(gact_kernels.dequantize(cpu.to("cuda")), y_cpu)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_stochastic_output_rounding_matches_cpu(dtype: torch.dtype) -> None:
    fi = torch.finfo(dtype)
    x = torch.cat([
        torch.linspace(fi.max / 2, fi.max, 64), torch.linspace(-fi.max, -fi.max / 2, 64),
        torch.arange(64) * fi.tiny * fi.eps, torch.linspace(0, 4 * fi.tiny, 64),
        torch.linspace(-1e-3, 1e-3, 64), 512 + torch.arange(64) % 9 * fi.eps * 512,
    ]).to(dtype)  # fmt: skip
    for bits in (2, 5, 8):
        cpu = gact_kernels.quantize(x, bits, group_size=64, seed=bits)
        gpu = gact_kernels.quantize(x.cuda(), bits, group_size=64, seed=bits)
        assert_same(cpu, gpu)
        assert bits_equal(gact_kernels.dequantize(gpu), gact_kernels.dequantize(cpu))


@requires_cuda
def test_cuda_channels_last() -> None:
    x = torch.randn(4, 32, 7, 7, device="cuda").contiguous(memory_format=torch.channels_last)
    q = gact_kernels.quantize(x, 4, seed=2)
    assert_same(q, gact_kernels.quantize(x.cpu(), 4, seed=2))
    y = gact_kernels.dequantize(q)
    assert y.stride() == x.stride() and bits_equal(y.cpu(), gact_kernels.dequantize(q.to("cpu")))


@requires_cuda
def test_cuda_non_contiguous_and_pinned() -> None:
    x = torch.randn(513, 257, device="cuda").t()
    q = gact_kernels.quantize(x, 4, seed=8)
    assert_same(q, gact_kernels.quantize(x.cpu(), 4, seed=8))
    host = q.to("cpu", pin_memory=True)
    # an empty buffer (no lossless groups here) has no memory to pin
    assert all(t.is_pinned() for t in host.buffers() if t.numel())
    back = host.to(x.device, non_blocking=True)
    assert bits_equal(gact_kernels.dequantize(back), gact_kernels.dequantize(q))


@requires_cuda
def test_cuda_more_than_2_pow_31_elements() -> None:
    n = 2**31 + 1000
    if torch.cuda.get_device_properties(0).total_memory < 16 * 2**30:
        pytest.skip("needs 16 GiB of GPU memory")
    x = torch.empty(n, dtype=torch.float16, device="cuda").uniform_(-1, 1)
    x[-1] = 5.0
    q = gact_kernels.quantize(x, 2, seed=11)
    assert q.data.numel() == math.ceil(n * 2 / 8) and q.lo.numel() == math.ceil(n / 256)
    tail = x[(n // 256) * 256 :].float()  # the last, partial group (232 elements)
    assert q.lo[-1].item() == tail.min().item()
    assert q.scale[-1].item() == pytest.approx((5.0 - tail.min().item()) / 3, rel=1e-6)
    y = gact_kernels.dequantize(q)
    for start in range(0, n, 2**28):
        part = slice(start, start + 2**28)
        step = q.scale.repeat_interleave(256)[:n][part].float()
        err = (y[part].float() - x[part].float()).abs()
        assert bool((err <= step * 1.001 + 1e-3).all())
