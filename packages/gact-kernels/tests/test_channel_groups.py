"""Groups that never span two channels (NOTE [channel groups] in _layout.py)."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from typing import Callable

import gact_kernels
import pytest
import torch
from gact_kernels._layout import channel_grouping, from_channel_runs, to_channel_runs
from gact_kernels.reference import reference_dequantize
from kernels_testing import DTYPES, bits_equal, requires_cuda

LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "every_other_sample": lambda t: t[::2],  # not dense: restored contiguous
}
SHAPES = {
    "1x1 maps, batch 64": (128, 40, 1, 1),
    "1x1 maps, batch 50 (padded runs)": (50, 24, 1, 1),
    "3x4 maps, batch 7 (two groups per run)": (7, 16, 3, 4),
    "5x7 maps, batch 3 (maps cut by groups)": (3, 8, 5, 7),
}


def _banded(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Channel c holds values in [10 c, 10 c + 1): any group spanning two channels has a range
    of at least 9, any group inside one a range below 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=gen) + 10 * torch.arange(shape[1]).view(1, -1, 1, 1)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shape", sorted(SHAPES), ids=str)
def test_no_group_spans_two_channels(shape: str, layout: str, dtype: torch.dtype) -> None:
    x = LAYOUTS[layout](_banded(SHAPES[shape], dtype))
    q = gact_kernels.quantize(x, 3, group_size=64, seed=5, channel_dim=1)
    assert q.channel_dim == 1 and q.group_size % 8 == 0 and q.group_size <= 64
    top = q.lo + q.scale * (2**q.bits - 1)
    assert float((top - q.lo).max()) < 2.0  # every group inside one channel's band
    y = gact_kernels.dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert y.stride() == (x.contiguous().stride() if layout == "every_other_sample" else x.stride())
    assert bits_equal(y, reference_dequantize(q))
    unit = 2 * torch.finfo(dtype).eps * float(x.float().abs().max())  # the output grid
    assert float((y.float() - x.float()).abs().max()) <= float(q.scale.max()) * 1.01 + unit


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_memory_order_groups_span_channels(layout: str) -> None:
    """The failure channel groups exist for: without them, groups of a 1x1 map cross bands."""
    x = LAYOUTS[layout](_banded((64, 40, 1, 1), torch.float32))
    q = gact_kernels.quantize(x, 3, group_size=64, seed=5)
    assert float(q.scale.max()) * 7 > 9.0


@pytest.mark.parametrize("zero_exact", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [*sorted(LAYOUTS), "channels_last_3d"])
@pytest.mark.parametrize("shape", sorted(SHAPES), ids=str)
def test_bytes_are_the_kernel_on_the_channel_block(
    shape: str, layout: str, dtype: torch.dtype, zero_exact: bool
) -> None:
    """The layout only reorders and pads: codes, minima, steps and noise are exactly those of
    ``quantize`` on the channel-major block with the chosen group size, whether the CPU kernels
    read the runs in place (contiguous, channels-last) or the block is copied; dequantize gives
    back what the plain kernel gives on the block, in the tensor's layout."""
    x = torch.randn(SHAPES[shape], generator=torch.Generator().manual_seed(1)).to(dtype)
    if layout == "channels_last_3d":
        x = (
            x.unsqueeze(2)
            .expand(-1, -1, 2, -1, -1)
            .contiguous(memory_format=torch.channels_last_3d)
        )
    else:
        x = LAYOUTS[layout](x)
    if zero_exact:
        x = x.relu()
    q = gact_kernels.quantize(x, 5, group_size=64, seed=9, zero_exact=zero_exact, channel_dim=1)
    group, run = channel_grouping(x.shape, 1, 64)
    block = to_channel_runs(x, 1, group)
    assert q.group_size == group and block.numel() == q.stored_numel == x.shape[1] * run
    plain = gact_kernels.quantize(block, 5, group_size=group, seed=9, zero_exact=zero_exact)
    for name in ("data", "lo", "scale"):
        assert bits_equal(getattr(q, name), getattr(plain, name)), name
    restored = from_channel_runs(
        gact_kernels.dequantize(plain), torch.empty_like(x.contiguous()), 1
    )
    assert bits_equal(gact_kernels.dequantize(q).contiguous(), restored)
    # padding repeats each channel's last element, so no group's range grows
    runs = block.view(x.shape[1], run)
    length = x.numel() // x.shape[1]
    assert bool((runs[:, length:] == runs[:, length - 1 : length]).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape,layout",
    [
        ((32, 24, 20, 20), torch.channels_last),
        ((30, 24, 7, 7), torch.channels_last),
        ((32, 20, 20, 20), torch.channels_last),
        ((24, 12, 13, 13), torch.contiguous_format),
        ((96, 12, 6, 6), torch.contiguous_format),
    ],
    ids=[
        "channels-last, tiles, whole runs",
        "channels-last, tiles, padded runs",
        "channels-last, 20 channels: no tiles",
        "NCHW, 13x13 maps: channel by channel",
        "NCHW, 6x6 maps: block by block",
    ],
)
def test_large_channel_runs_on_two_threads(
    shape: tuple[int, ...], layout: torch.memory_format, dtype: torch.dtype
) -> None:
    """Tensors large enough for the threaded loops, which visit the groups of channels-last
    and small-map runs block by block across channels, and gather and scatter eight
    channels-last channels at a time (NOTE [group order] and NOTE [channel tiles] in
    csrc/cpu.cpp): the bytes and values are the plain kernel's on the channel-major block, and
    so the same on any number of threads."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    x = x.contiguous(memory_format=layout)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q = gact_kernels.quantize(x, 3, group_size=64, seed=5, channel_dim=1)
        restored = gact_kernels.dequantize(q)
    finally:
        torch.set_num_threads(threads)
    group, _ = channel_grouping(x.shape, 1, 64)
    plain = gact_kernels.quantize(to_channel_runs(x, 1, group), 3, group_size=group, seed=5)
    for name in ("data", "lo", "scale"):
        assert bits_equal(getattr(q, name), getattr(plain, name)), name
    expected = from_channel_runs(gact_kernels.dequantize(plain), torch.empty_like(x), 1)
    assert restored.stride() == x.stride() and bits_equal(restored, expected)


def test_lossless_groups_of_channel_runs() -> None:
    """A NaN in a channel run: the group is stored losslessly (gathered from the block) and
    comes back bit-exact, in place of the kernels' in-place path."""
    x = torch.randn(7, 16, 3, 4, generator=torch.Generator().manual_seed(2))
    x[3, 5, 1, 2] = float("nan")
    for t in (x, x.contiguous(memory_format=torch.channels_last)):
        q = gact_kernels.quantize(t, 4, group_size=64, seed=1, channel_dim=1)
        assert q.lossless_groups.numel() == 1
        y = gact_kernels.dequantize(q)
        assert y.stride() == t.stride() and bool(torch.isnan(y[3, 5, 1, 2]))
        group, _ = channel_grouping(x.shape, 1, 64)
        plain = gact_kernels.quantize(to_channel_runs(t, 1, group), 4, group_size=group, seed=1)
        restored = from_channel_runs(gact_kernels.dequantize(plain), torch.empty_like(x), 1)
        assert bits_equal(y.contiguous(), restored)


@pytest.mark.parametrize(
    "shape,expected",
    [((50, 512, 1, 1), (56, 56)), ((64, 512, 1, 1), (64, 64)), ((1, 64, 56, 56), (248, 3224))],
)
def test_grouping_is_the_fewest_even_groups(
    shape: tuple[int, ...], expected: tuple[int, int]
) -> None:
    group, run = channel_grouping(torch.Size(shape), 1, 256)
    assert (group, run) == expected
    length = math.prod(shape) // shape[1]
    assert run - length < 8 * (run // group)  # fewer than 8 padded elements per group


@pytest.mark.parametrize("plane,group", [((16, 16), 256), ((56, 56), 224), ((5, 48), 240)])
def test_planes_of_whole_groups_need_no_copy(plane: tuple[int, int], group: int) -> None:
    """A contiguous NCHW tensor whose planes split into whole groups of 128-256 elements is
    stored in memory order with that group size."""
    x = torch.randn(2, 3, *plane)
    q = gact_kernels.quantize(x, 4, seed=2, channel_dim=1)
    assert q.channel_dim is None and q == gact_kernels.quantize(x, 4, seed=2, group_size=group)


def test_planes_without_such_groups_are_copied() -> None:
    for plane in ((28, 28), (14, 14), (7, 7)):
        q = gact_kernels.quantize(torch.randn(2, 3, *plane), 4, channel_dim=1)
        assert q.channel_dim == 1, plane


def test_channel_of_small_scale_keeps_its_precision() -> None:
    """Channels of scales 1e-3 .. 10 at 4 bits: each channel's rounding error stays a fraction
    of its own spread with channel groups; in memory order the small channels lose it all."""
    gen = torch.Generator().manual_seed(3)
    scales = torch.logspace(-3, 1, 256).view(1, -1, 1, 1)
    x = torch.randn(64, 256, 1, 1, generator=gen) * scales
    spread = x.std((0, 2, 3))

    def worst(**kw: int) -> float:
        y = gact_kernels.dequantize(gact_kernels.quantize(x, 4, seed=4, **kw))
        return float(((y - x).pow(2).mean((0, 2, 3)).sqrt() / spread).max())

    assert worst(channel_dim=1) < 0.3
    assert worst() > 3.0


def test_channel_groups_are_unbiased() -> None:
    """E[round trip] = x through the channel layout (padded runs, float16 output).

    2,000 seeds; each sample lies within one step (plus a float16 unit) of x, so Hoeffding
    bounds |mean - x| by R sqrt(ln(2/delta) / 4000) with delta = 1e-9 per element: the
    false-alarm probability over the 600 elements is below 6e-7.
    """
    x = (torch.randn(50, 12, 1, 1, generator=torch.Generator().manual_seed(8)) * 3).half()
    samples = torch.stack(
        [
            gact_kernels.dequantize(gact_kernels.quantize(x, 2, seed=s, channel_dim=1))
            for s in range(2000)
        ]
    ).double()
    q = gact_kernels.quantize(x, 2, seed=0, channel_dim=1)
    spread = float(q.scale.max()) + 2 * float(x.double().abs().max()) * 2**-10
    bound = spread * math.sqrt(math.log(2 / 1e-9) / (2 * 2000))
    assert float((samples.mean(0) - x.double()).abs().max()) < bound


def test_container_survives_copies() -> None:
    x = _banded((50, 24, 1, 1), torch.bfloat16)
    q = gact_kernels.quantize(x, 4, seed=1, channel_dim=-3)
    assert q.channel_dim == 1
    for clone in (copy.deepcopy(q), pickle.loads(pickle.dumps(q)), q.to("cpu")):
        assert clone == q and bits_equal(gact_kernels.decompress(clone), gact_kernels.dequantize(q))


@pytest.mark.parametrize("channel_dim", [4, -5])
def test_channel_dim_out_of_range(channel_dim: int) -> None:
    with pytest.raises(ValueError, match="channel_dim must name a dimension"):
        gact_kernels.quantize(torch.randn(2, 3, 4, 5), 4, channel_dim=channel_dim)


def test_channel_dim_must_be_an_int() -> None:
    with pytest.raises(TypeError, match="channel_dim must be an int"):
        gact_kernels.quantize(torch.randn(2, 3), 4, channel_dim=1.0)  # type: ignore[arg-type]


def test_hand_built_container_is_checked() -> None:
    q = gact_kernels.quantize(_banded((50, 24, 1, 1), torch.float32), 4, channel_dim=1)
    with pytest.raises(ValueError, match=r"QuantizedTensor\.channel_dim must name a dimension"):
        dataclasses.replace(q, channel_dim=7)
    with pytest.raises(ValueError, match=r"QuantizedTensor\.data"):  # padded codes, plain layout
        dataclasses.replace(q, channel_dim=None)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_matches_cpu(layout: str, dtype: torch.dtype) -> None:
    """The layout is torch code and the kernels are byte-equal: CUDA stores and restores what
    the CPU does."""
    x = LAYOUTS[layout](_banded(SHAPES["1x1 maps, batch 50 (padded runs)"], dtype))
    cpu = gact_kernels.quantize(x, 3, seed=5, channel_dim=1)
    cuda = gact_kernels.quantize(x.cuda(), 3, seed=5, channel_dim=1)
    assert cuda.to("cpu") == cpu
    assert bits_equal(gact_kernels.dequantize(cuda).cpu(), gact_kernels.dequantize(cpu))
