"""The sign-exact grid of ``quantize(..., zero_exact=True)`` for groups whose minimum is zero.

Bytes against the torch reference, the sign guarantee on non-negative inputs, unchanged bytes
for groups that do not use the grid, the output rounding near the smallest normal number, and
the container field. Unbiasedness and variance are in test_statistics.py.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import gact_kernels
import pytest
import torch
from gact_kernels.reference import reference_dequantize, reference_quantize, round_stochastic
from hypothesis import given, settings
from hypothesis import strategies as st
from kernels_testing import DTYPES, bits_equal, requires_cuda

BITS = range(2, 9)


def tiny_of(dtype: torch.dtype) -> float:
    """The smallest positive normal number of ``dtype``: the first level of the grid."""
    return torch.finfo(dtype).tiny


def relu_like(dtype: torch.dtype, group: int, seed: int = 0) -> torch.Tensor:
    """Non-negative groups of ``group`` elements that are hard on the sign: about half zeros
    (``-0.0`` among them) with positives from far below the smallest normal number up to the
    largest finite value, plus all-positive, all-zero, below-normal-only and lossless (+inf)
    groups."""
    fi = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(seed)
    sub = fi.tiny * fi.eps  # smallest subnormal

    def rand(*scale: float) -> torch.Tensor:
        lo, hi = (0.0, scale[0]) if len(scale) == 1 else scale
        return lo + (hi - lo) * torch.rand(group, generator=gen, dtype=torch.float64)

    def with_zeros(v: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(group, generator=gen) < 0.5
        keep[0] = False  # every such group holds a zero
        zero = torch.where(torch.rand(group, generator=gen) < 0.3, -0.0, 0.0)
        return torch.where(keep, v, zero.double())

    below = torch.tensor([sub, 3 * sub, fi.tiny / 4, fi.tiny / 2, fi.tiny * (1 - fi.eps)])
    near_tiny = torch.tensor([fi.tiny, fi.tiny * (1 + fi.eps), fi.tiny * 1.5, fi.tiny * 2])
    below, near_tiny = below.double(), near_tiny.double()
    parts = [
        with_zeros(torch.randn(group, generator=gen, dtype=torch.float64).abs()),
        with_zeros(rand(2.0)).index_put_((torch.arange(1, 10),), torch.cat([below, near_tiny])),
        with_zeros(rand(1e-3)),
        with_zeros(rand(fi.max / 2, fi.max)).index_put_((torch.tensor([1]),), below[2:3]),
        with_zeros(512 + fi.eps * 512 * torch.randint(0, 9, (group,), generator=gen).double()),
        with_zeros(rand(600 * fi.tiny)).index_put_((torch.arange(1, 6),), below),
        with_zeros(torch.full((group,), fi.tiny, dtype=torch.float64)),  # hi == tiny: step 0
        with_zeros(rand(fi.tiny)),  # every positive below tiny (lossless unless float16)
        with_zeros(rand(8 * sub)),  # a range of a few subnormals (lossless unless float16)
        torch.zeros(group, dtype=torch.float64).index_fill_(0, torch.tensor([5]), 3.0),
        with_zeros(rand(2.0)).index_fill_(0, torch.tensor([3]), math.inf),  # lossless
        rand(0.5, 2.0),  # no zero: the normal grid, minimum > 0
        torch.zeros(group, dtype=torch.float64),  # constant zeros
        torch.where(torch.rand(group, generator=gen) < 0.5, -0.0, 0.0).double(),  # signed zeros
    ]
    return torch.cat(parts).to(dtype)


def assert_sign_exact(x: torch.Tensor, y: torch.Tensor) -> None:
    assert y.dtype == x.dtype and y.shape == x.shape
    assert bool(((y > 0) == (x > 0)).all()), int(((y > 0) != (x > 0)).sum())
    assert bool(((y == 0) == (x == 0)).all()), int(((y == 0) != (x == 0)).sum())


@pytest.mark.parametrize("group_size", [8, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_matches_reference_and_sign_exact(bits: int, dtype: torch.dtype, group_size: int) -> None:
    x = relu_like(dtype, 64, seed=bits)
    for seed in (0, 2**64 - 1):
        q = gact_kernels.quantize(x, bits, group_size=group_size, seed=seed, zero_exact=True)
        assert q.zero_exact is True
        r = reference_quantize(x, bits, group_size=group_size, seed=seed, zero_exact=True)
        assert q == r
        y = gact_kernels.dequantize(q)
        assert bits_equal(y, reference_dequantize(r))
        assert_sign_exact(x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_sign_exact_over_many_seeds(bits: int, dtype: torch.dtype) -> None:
    x = relu_like(dtype, 64, seed=100 + bits).repeat(64)  # every element at 64 stream positions
    for seed in range(8):
        q = gact_kernels.quantize(x, bits, group_size=64, seed=seed, zero_exact=True)
        assert_sign_exact(x, gact_kernels.dequantize(q))

    # The normal grid does flip signs on the same data (what the mode is for).
    def normal(seed: int) -> torch.Tensor:
        return gact_kernels.dequantize(gact_kernels.quantize(x, bits, group_size=64, seed=seed))

    assert sum(int(((normal(s) > 0) != (x > 0)).sum()) for s in range(8)) > 0


@settings(max_examples=80, deadline=None)
@given(
    bits=st.integers(2, 8),
    dtype=st.sampled_from(DTYPES),
    group_size=st.sampled_from([8, 16, 40, 256]),
    seed=st.integers(0, 2**64 - 1),
    n=st.integers(0, 700),
    log_scale=st.floats(-40, 38),
    zero_fraction=st.floats(0, 1),
)
def test_property_sign_exact_and_reference(
    bits, dtype, group_size, seed, n, log_scale, zero_fraction
) -> None:
    gen = torch.Generator().manual_seed(seed % 2**63)
    fi = torch.finfo(dtype)
    x = torch.randn(n, generator=gen, dtype=torch.float64).abs() * 10.0**log_scale
    x = torch.where(torch.rand(n, generator=gen) < zero_fraction, 0.0, x)
    x = x.clamp(max=fi.max).to(dtype)
    q = gact_kernels.quantize(x, bits, group_size=group_size, seed=seed, zero_exact=True)
    assert q == reference_quantize(x, bits, group_size=group_size, seed=seed, zero_exact=True)
    y = gact_kernels.dequantize(q)
    assert bits_equal(y, reference_dequantize(q))
    assert_sign_exact(x, y)


def _zero_exact_groups(q: gact_kernels.QuantizedTensor) -> torch.Tensor:
    """Groups that use the sign-exact grid: lo == +0 (bit pattern 0) and not lossless."""
    return (q.lo.view(torch.int32) == 0) & ~torch.isnan(q.scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_below_tiny_restores_tiny_and_zeros_restore_zero(bits: int, dtype: torch.dtype) -> None:
    x = relu_like(dtype, 64, seed=7)
    q = gact_kernels.quantize(x, bits, group_size=64, seed=3, zero_exact=True)
    y = gact_kernels.dequantize(q)
    grid = _zero_exact_groups(q).repeat_interleave(64)[: x.numel()]
    below = grid & (x > 0) & (x < tiny_of(dtype))
    assert int(below.sum()) > 0
    assert bool((y[below] == tiny_of(dtype)).all())  # code 1, exactly tiny in every dtype
    assert bool((y[x == 0] == 0).all())
    assert bool((y[grid & (x > 0)] >= tiny_of(dtype)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_grid_levels_and_codes(bits: int, dtype: torch.dtype) -> None:
    """The stored step is (hi - tiny) / (2^b - 2); codes are 0 exactly for zeros; the top
    element comes back as the last level; the normal grid keeps its bytes elsewhere."""
    tiny = tiny_of(dtype)
    x = torch.tensor([0.0, 1.0, 0.5, 0.0, 0.25, -0.0, 0.75, 2.0**-130], dtype=dtype)
    q = gact_kernels.quantize(x, bits, group_size=8, seed=1, zero_exact=True)
    step = (torch.tensor(1.0) - torch.tensor(tiny)) / torch.tensor(float(2**bits - 2))
    assert q.lo.view(torch.int32).tolist() == [0] and q.scale.tolist() == [step.item()]
    codes = _codes(q)
    assert (codes == 0).tolist() == (x == 0).tolist()
    assert int(codes[-1]) == 1 or x[-1] == 0  # below tiny (2^-130 is 0 in float16)
    y = gact_kernels.dequantize(q)
    assert abs(y[1].item() - 1.0) <= torch.finfo(dtype).eps  # 2^b - 2 steps above tiny: hi
    assert y[x == 0].tolist() == [0.0] * int((x == 0).sum())


def _codes(q: gact_kernels.QuantizedTensor) -> torch.Tensor:
    """The b-bit codes of q in memory order."""
    bits = ((q.data.long()[:, None] >> torch.arange(8)) & 1).flatten()
    bits = bits[: q.numel * q.bits].view(-1, q.bits)
    return (bits << torch.arange(q.bits)).sum(1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3000),  # every group holds a negative: lo < 0
        lambda: torch.rand(3000) + 0.5,  # lo > 0
        lambda: torch.randn(3000).abs() + torch.finfo(torch.float32).tiny,  # lo > 0, tiny
        lambda: torch.randn(3000).index_fill_(0, torch.tensor([3, 700]), float("nan")),
    ],
    ids=["negative", "positive", "just-positive", "lossless"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_without_zero_minimum_groups_are_unchanged(make, dtype: torch.dtype) -> None:
    x = make().to(dtype)
    for bits in (2, 5, 8):
        normal = gact_kernels.quantize(x, bits, seed=9)
        exact = gact_kernels.quantize(x, bits, seed=9, zero_exact=True)
        assert not _zero_exact_groups(exact).any()
        assert exact == dataclasses.replace(normal, zero_exact=True)
        assert bits_equal(gact_kernels.dequantize(exact), gact_kernels.dequantize(normal))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_tensor_changes_only_zero_minimum_groups(dtype: torch.dtype) -> None:
    """Negative inputs are allowed: their groups (lo < 0) keep the normal grid byte for byte."""
    x = torch.randn(40, 64)
    x[::3] = x[::3].relu()  # rows 0, 3, 6, ... hold zeros and positives only
    x = x.to(dtype).flatten()
    for bits in (2, 3, 8):
        normal = gact_kernels.quantize(x, bits, group_size=64, seed=5)
        exact = gact_kernels.quantize(x, bits, group_size=64, seed=5, zero_exact=True)
        grid = _zero_exact_groups(exact)
        assert grid.tolist() == [g % 3 == 0 for g in range(40)]
        assert torch.equal(exact.lo, normal.lo) and exact.nbytes == normal.nbytes
        assert torch.equal(exact.scale[~grid], normal.scale[~grid])
        per_group = 64 * bits // 8
        same = exact.data.view(40, per_group) == normal.data.view(40, per_group)
        assert bool(same[~grid].all()) and not bool(same[grid].all())
        y_exact, y_normal = gact_kernels.dequantize(exact), gact_kernels.dequantize(normal)
        assert bits_equal(y_exact.view(40, 64)[~grid], y_normal.view(40, 64)[~grid])
        assert_sign_exact(x.view(40, 64)[grid], y_exact.view(40, 64)[grid])


def test_float16_groups_below_tiny_round_up_to_tiny() -> None:
    """A float16 group of zeros and positives below 2^-14 is coded (not lossless) with a step
    of 0: every positive becomes tiny (a bias below tiny, as specified)."""
    sub = 2.0**-24
    x = torch.tensor([0.0, sub, 5 * sub, 0.0, 2.0**-15, 0.0, 1000 * sub, 0.0]).half()
    q = gact_kernels.quantize(x, 3, group_size=8, seed=2, zero_exact=True)
    assert q.lossless_groups.numel() == 0 and q.scale.tolist() == [0.0]
    y = gact_kernels.dequantize(q)
    assert y.tolist() == [0.0 if v == 0 else 2.0**-14 for v in x.tolist()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_smallest_coded_ranges_have_normal_steps(dtype: torch.dtype) -> None:
    """Why no extra lossless rule is needed for fp32/bf16: a group with lo = 0 is coded only if
    fl(hi / (2^b - 1)) >= 2^-126 (the existing rule), and every such hi gives a sign-exact step
    fl((hi - tiny) / (2^b - 2)) >= 2^-126 (NOTE [storage and RNG invariants])."""
    tiny = torch.tensor(2.0**-126)
    for bits in BITS:
        d = float(2**bits - 1)
        # Both tests are monotone in hi (fl is), so only the smallest coded hi needs checking;
        # it lies in a window of +-2^-5 around the exact threshold d * 2^-126 (asserted).
        lo_bits = torch.tensor(d * 2.0**-126 * (1 - 2**-5)).view(torch.int32).item()
        hi_bits = torch.tensor(d * 2.0**-126 * (1 + 2**-5)).view(torch.int32).item()
        hi = torch.arange(lo_bits, hi_bits, dtype=torch.int32).view(torch.float32)
        hi = hi[hi == hi.to(dtype).float()]  # the values the input dtype can hold
        coded = hi / torch.tensor(d) >= tiny
        assert bool(coded.any()) and not bool(coded.all())  # the window holds the threshold
        step = (hi - tiny).clamp(min=0) / torch.tensor(d - 1)
        assert bool((step[coded] >= tiny).all()), bits
        x = torch.zeros(8, dtype=dtype)
        x[1] = hi[coded][0]
        q = gact_kernels.quantize(x, bits, group_size=8, zero_exact=True)
        assert q.lossless_groups.numel() == 0 and q.scale.item() >= 2.0**-126
        assert_sign_exact(x, gact_kernels.dequantize(q))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_output_rounding_never_turns_a_level_into_zero(dtype: torch.dtype) -> None:
    """fp16/bf16 outputs round levels stochastically; a level >= tiny (every positive level of
    the grid) stays >= tiny for every value of the random bits the rule reads."""
    tiny = tiny_of(dtype)
    levels = torch.tensor([tiny, tiny * (1 + 2**-23), tiny * 1.5, tiny * (2 - 2**-23), 1.0])
    every_h = torch.arange(2**16, dtype=torch.int64) << 16 | 0xFFFF  # all bits the rule reads
    for v in levels:
        out = round_stochastic(v.expand(every_h.numel()), every_h, dtype)
        assert bool((out >= tiny).all()), float(v)
    # Through the kernel: a hand-built group whose codes 1 and 2 sit at tiny and just above it.
    n = 2**16
    step = tiny * 2.0**-10
    codes = torch.tensor([1, 2] * (n // 2))
    bits = 2
    word = (codes.view(-1, 4) << (torch.arange(4) * bits)).sum(1).to(torch.uint8)
    q = gact_kernels.QuantizedTensor(
        word, torch.zeros(1), torch.tensor([step], dtype=torch.float32),
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, n, dtype=dtype),
        bits=bits, group_size=n, seed=11, shape=torch.Size([n]), stride=(1,), dtype=dtype,
        zero_exact=True, channel_dim=None,
    )  # fmt: skip
    y = gact_kernels.dequantize(q)
    assert bits_equal(y, reference_dequantize(q))
    assert bool((y[0::2] == tiny).all()) and bool((y[1::2] >= tiny).all())


def test_mode_is_decoded_from_the_container() -> None:
    x = torch.randn(4096).relu()
    q = gact_kernels.quantize(x, 2, seed=4, zero_exact=True)
    plain = dataclasses.replace(q, zero_exact=False)
    assert q != plain
    assert not bits_equal(gact_kernels.dequantize(q), gact_kernels.dequantize(plain))
    assert_sign_exact(x, gact_kernels.decompress(q))


def test_container_field_pickles_and_shows() -> None:
    q = gact_kernels.quantize(torch.randn(1000).relu().bfloat16(), 3, seed=2, zero_exact=True)
    back = pickle.loads(pickle.dumps(q))
    assert back == q and back.zero_exact is True
    assert bits_equal(gact_kernels.dequantize(back), gact_kernels.dequantize(q))
    assert "zero_exact=True" in repr(q)
    assert gact_kernels.quantize(torch.ones(8), 1).zero_exact is False


def test_errors() -> None:
    x = torch.randn(100).relu()
    with pytest.raises(ValueError, match=r"zero_exact=True needs bits >= 2"):
        gact_kernels.quantize(x, 1, zero_exact=True)
    with pytest.raises(TypeError, match=r"zero_exact must be a bool, got int"):
        gact_kernels.quantize(x, 2, zero_exact=1)
    with pytest.raises(ValueError, match=r"zero_exact=True needs bits >= 2"):
        reference_quantize(x, 1, zero_exact=True)
    q = gact_kernels.quantize(x, 2, zero_exact=True)
    with pytest.raises(TypeError, match=r"QuantizedTensor\.zero_exact must be a bool"):
        dataclasses.replace(q, zero_exact=None)
    with pytest.raises(ValueError, match=r"QuantizedTensor\.zero_exact=True needs bits >= 2"):
        dataclasses.replace(q, bits=1, data=q.data[: math.ceil(100 / 8)])


def test_deterministic_across_thread_counts() -> None:
    x = torch.randn(200_000).relu()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gact_kernels.quantize(x, 3, seed=8, zero_exact=True)
        torch.set_num_threads(3)
        assert one == gact_kernels.quantize(x, 3, seed=8, zero_exact=True)
    finally:
        torch.set_num_threads(before)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_cuda_matches_cpu_bytes(bits: int, dtype: torch.dtype) -> None:
    x = torch.cat([relu_like(dtype, 64, seed=bits), torch.randn(3001).to(dtype)])
    x[17] = float("nan")
    for group_size in (8, 64, 256):
        cpu = gact_kernels.quantize(x, bits, group_size=group_size, seed=6, zero_exact=True)
        gpu = gact_kernels.quantize(x.cuda(), bits, group_size=group_size, seed=6, zero_exact=True)
        assert gpu.to("cpu") == cpu
        y_cpu = gact_kernels.dequantize(cpu)
        assert bits_equal(gact_kernels.dequantize(gpu), y_cpu)
        assert bits_equal(gact_kernels.dequantize(cpu.to("cuda")), y_cpu)
