"""Restored tensors keep the memory layout they were compressed with (NOTE [memory order])."""

from __future__ import annotations

from typing import Callable

import gact_kernels
import pytest
import torch
from gact_kernels.reference import reference_quantize
from kernels_testing import assert_within_one_step, bits_equal, memory_flat

DENSE_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "transposed": lambda t: t.transpose(1, 3),
    "permuted": lambda t: t.permute(2, 0, 3, 1),
    "size_one_dims": lambda t: t[:1].transpose(0, 1),  # stride of a size-1 dim is arbitrary
}
GAPPED_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "expanded": lambda t: t[:, :1].expand(-1, 6, -1, -1),  # stride 0: overlapping
    "sliced": lambda t: t[:, :, 1:],
    "strided": lambda t: t[..., ::2],
}


def _base(dtype: torch.dtype) -> torch.Tensor:
    t = torch.randn(2, 6, 7, 9, generator=torch.Generator().manual_seed(0))
    if dtype == torch.bool:
        return t > 0
    if not dtype.is_floating_point:
        return (t * 1000).to(dtype)
    return t.to(dtype)


ROUND_TRIPS = {
    "quantize": (torch.bfloat16, lambda t: gact_kernels.quantize(t, 8, group_size=64, seed=1)),
    "pack_mask": (torch.bool, gact_kernels.pack_mask),
    "pack_ints": (torch.int32, lambda t: gact_kernels.pack_ints(t, group_size=64)),
}


@pytest.mark.parametrize("view", sorted(DENSE_VIEWS))
@pytest.mark.parametrize("kind", sorted(ROUND_TRIPS))
def test_dense_layouts_keep_strides(kind: str, view: str) -> None:
    dtype, compress = ROUND_TRIPS[kind]
    x = DENSE_VIEWS[view](_base(dtype))
    c = compress(x)
    y = gact_kernels.decompress(c)
    assert y.shape == x.shape and y.stride() == x.stride() and c.stride == x.stride()
    if kind == "quantize":
        assert_within_one_step(x, c)
    else:
        assert torch.equal(y, x)


@pytest.mark.parametrize("view", sorted(GAPPED_VIEWS))
@pytest.mark.parametrize("kind", sorted(ROUND_TRIPS))
def test_other_layouts_come_back_contiguous(kind: str, view: str) -> None:
    dtype, compress = ROUND_TRIPS[kind]
    x = GAPPED_VIEWS[view](_base(dtype))
    c = compress(x)
    y = gact_kernels.decompress(c)
    assert y.is_contiguous() and y.shape == x.shape
    if kind == "quantize":
        assert_within_one_step(x, c)
        assert c == compress(x.contiguous())  # grouped in C order, as the copy
    else:
        assert torch.equal(y, x)


def test_dense_input_is_read_in_memory_order_without_copy() -> None:
    x = torch.randn(4, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    q = gact_kernels.quantize(x, 4, group_size=64, seed=3)
    same = gact_kernels.quantize(memory_flat(x), 4, group_size=64, seed=3)
    assert torch.equal(q.data, same.data) and torch.equal(q.lo, same.lo)
    assert q == reference_quantize(x, 4, group_size=64, seed=3)
    # channels-last groups are runs of channels of one pixel, not runs of one channel's pixels
    assert q.lo[0] == x[0, :, 0, :4].min()


def test_channels_last_bit_exact_against_contiguous_restore() -> None:
    x = torch.randn(2, 8, 5, 5).bfloat16().contiguous(memory_format=torch.channels_last)
    q = gact_kernels.quantize(x, 2, group_size=8, seed=9)
    y = gact_kernels.dequantize(q)
    assert y.is_contiguous(memory_format=torch.channels_last)
    cont = gact_kernels.quantize(memory_flat(x).clone(), 2, group_size=8, seed=9)
    assert bits_equal(memory_flat(y), gact_kernels.dequantize(cont))


def test_empty_tensors_keep_their_strides() -> None:
    x = torch.empty(0, 3, 4).transpose(1, 2)
    for c in (
        gact_kernels.quantize(x, 3),
        gact_kernels.pack_mask(x.bool()),
        gact_kernels.pack_ints(x.long()),
    ):
        y = gact_kernels.decompress(c)
        assert y.shape == x.shape and y.stride() == x.stride() and c.nbytes == 0


@pytest.mark.parametrize("view", ["contiguous", "channels_last"])
def test_lazily_negated_inputs_are_read_as_their_values(view: str) -> None:
    """A negative view (``torch._neg_view``, what conjugate-free ops may hand over) shares its
    base's memory, which holds the values' negatives: the kernels must read its values."""
    x = DENSE_VIEWS[view](_base(torch.float32))
    negated = torch._neg_view(x)
    assert negated.is_neg() and negated.data_ptr() == x.data_ptr()
    expected = gact_kernels.quantize(-x, 4, seed=5)
    assert gact_kernels.quantize(negated, 4, seed=5) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_that_require_grad_are_quantized_as_their_data(dtype: torch.dtype) -> None:
    """The pending result holds its input until resolved, never the input's autograd graph."""
    leaf = _base(dtype).requires_grad_()
    x = leaf * 2  # a non-leaf: it carries a graph
    pending = gact_kernels.quantize_async(x, 3, seed=2)
    assert pending.result() == gact_kernels.quantize(x.detach(), 3, seed=2)
    assert gact_kernels.quantize(leaf, 3, seed=2) == gact_kernels.quantize(leaf.detach(), 3, seed=2)
