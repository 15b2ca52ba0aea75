"""Memory layouts: compressing a tensor in the order of its memory and restoring its strides."""

from __future__ import annotations

import functools
import math
import operator

import torch

from ._checks import integer

__all__ = [
    "channel_grouping",
    "channel_runs",
    "check_layout",
    "contiguous_stride",
    "empty_with_layout",
    "flat_view",
    "from_channel_runs",
    "memory_order",
    "padded_run",
    "plane_group",
    "restore_stride",
    "to_channel_runs",
]

# NOTE [memory order]
# A tensor whose elements tile one block of memory without gaps or overlaps ("non-overlapping
# and dense": contiguous, channels-last, any permutation of dimensions) is compressed as that
# block, in address order, with no copy; the container keeps its strides and the restored
# tensor is allocated with ``torch.empty_strided(shape, stride)``, so a channels-last
# activation comes back channels-last (compiled backward graphs assert on strides). Every other
# tensor (overlapping, e.g. ``expand``; with gaps, e.g. slices) is copied contiguous first and
# comes back contiguous. Group g is therefore "elements g*G .. of the memory block", not of the
# logical C order; the two agree for contiguous tensors.


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """Strides of a C-contiguous tensor of ``shape``.

    Example:
        >>> contiguous_stride(torch.Size([2, 3, 4]))
        (12, 4, 1)
    """
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


@functools.lru_cache(maxsize=4096)  # a training step meets the same few layouts every time
def _is_dense(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out over one gapless, non-overlapping block."""
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


def memory_order(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A block holding ``x``'s elements in memory order at its address, and the strides to
    restore: ``x`` itself when contiguous, else a flat view of it.

    See NOTE [memory order]: a non-overlapping, dense ``x`` is read without a copy; anything
    else is copied contiguous. The kernels read the block's address and size only, so a
    contiguous ``x`` gets no view built (a save's cost); torch code that indexes the block
    flattens it with ``.view(-1)``.
    """
    x = x.resolve_neg()
    stride = x.stride()
    if x.is_contiguous():
        return x, stride
    if _is_dense(x.shape, stride):
        return x.as_strided((x.numel(),), (1,)), stride
    x = x.contiguous()
    return x, x.stride()


def restore_stride(x: torch.Tensor) -> tuple[int, ...]:
    """The strides a restored copy of ``x`` gets: ``x``'s own if dense, else contiguous."""
    stride = x.stride()
    if x.numel() == 0 or x.is_contiguous() or _is_dense(x.shape, stride):
        return stride
    return contiguous_stride(x.shape)


# NOTE [channel groups]
# A group of consecutive elements of an NCHW tensor spans several channels once a channel's
# plane is smaller than the group (ResNet stages on small images: 8x8, 4x4, 1x1 maps), and of a
# channels-last tensor always. The channel of largest range then sets the step of every other,
# and a channel of small scale keeps almost no precision; BatchNorm divides that error by the
# channel's standard deviation. On a ResNet-18 at 32x32 the 1x1 maps of its last stage had
# channels whose rounding error was 2-4x their own standard deviation after 20 steps, and
# training diverged within 30-60 steps at 4 bits (BENCHMARKS.md, "Stability"). With
# ``channel_dim`` the elements are grouped channel by channel instead: the tensor is copied in
# channel-major order (channel, then every other dimension in order), each channel's run of
# ``L = numel / C`` elements is padded to a whole number of groups by repeating its last
# element (which changes no group's range), and the kernels quantize that block as usual, so the
# bytes and the noise are those of ``quantize`` on it. ``channel_grouping`` picks the group: the
# fewest groups of at most ``group_size`` per run, each a multiple of 8, as equal as possible
# (a 1x1 map at batch 64: 64; batch 50: 56, 6 padded; 56x56 at batch 1: 13 groups of 248).
# When the plain memory order can keep groups inside channels, no copy is made and the container
# is an ordinary one: a contiguous tensor whose channel planes (the elements after the channel
# dimension) split into whole groups of a multiple of 8 between ``group_size / 2`` and
# ``group_size`` (``plane_group``: 16x16 and 32x32 maps at 256; 56x56 at 224, which costs 0.29
# bits of metadata per element instead of 0.25). Other planes (7x7, 14x14, 28x28, anything
# smaller than a group) are grouped channel-major all the same. On the CPU, a contiguous or
# channels-last tensor is read (and restored) in place: the kernels gather each group from the
# channel's pieces of ``inner`` contiguous elements (``channel_runs``; ``quantize_runs`` and
# ``dequantize_runs`` in csrc/cpu.cpp), same bytes and values as on the copied block. Other
# layouts, the rare tensors with lossless groups, and CUDA take the copy, about one memory copy
# of the tensor each way.


@functools.lru_cache(maxsize=4096)
def channel_grouping(shape: torch.Size, channel_dim: int, group_size: int) -> tuple[int, int]:
    """The group size and padded run length of channel groups (NOTE [channel groups]).

    Example:
        >>> channel_grouping(torch.Size([50, 512, 1, 1]), 1, 256)
        (56, 56)
    """
    channels = shape[channel_dim]
    run = shape.numel() // channels
    count = -(-run // group_size)
    group = (-(-run // count) + 7) // 8 * 8
    return group, padded_run(run, group)


def padded_run(run: int, group: int) -> int:
    """A channel's run of ``run`` elements padded to whole groups of ``group``."""
    return -(-run // group) * group


def _channel_view(t: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """``t`` with ``channel_dim`` first: a (C, outer, inner) view when ``t`` is contiguous (its
    copies then move rows of ``inner`` elements), else ``movedim``'s view."""
    if not t.is_contiguous():
        return t.movedim(channel_dim, 0)
    channels = t.shape[channel_dim]
    inner = math.prod(t.shape[channel_dim + 1 :])
    return t.view(-1, channels, inner).transpose(0, 1)


def plane_group(plane: int, group_size: int) -> int | None:
    """The largest multiple of 8 in ``[group_size / 2, group_size]`` dividing ``plane``, if any
    (NOTE [channel groups]).

    Example:
        >>> plane_group(56 * 56, 256), plane_group(28 * 28, 256)
        (224, None)
    """
    for group in range(group_size - group_size % 8, (group_size + 1) // 2 - 1, -8):
        if group >= 8 and plane % group == 0:
            return group
    return None


def channel_runs(t: torch.Tensor, channel_dim: int, run: int) -> tuple[int, int, int, int] | None:
    """``(outer, channels, inner, run)`` when the CPU kernels can read (or write) the
    channel-major block of ``t`` in place: ``t``'s memory is ``[outer][channels][inner]`` and
    each channel's elements lie in its logical order (contiguous, or channels-last with
    ``channel_dim == 1``); ``None`` otherwise, and then the block is copied (NOTE [channel
    groups]).

    Example:
        >>> x = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
        >>> channel_runs(x.contiguous(), 1, 40), channel_runs(x, 1, 40)
        ((2, 3, 20, 40), (40, 3, 1, 40))
    """
    channels = t.shape[channel_dim]
    if t.is_contiguous():
        inner = math.prod(t.shape[channel_dim + 1 :])
        return t.numel() // (channels * inner), channels, inner, run
    if channel_dim == 1 and (
        (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
        or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))
    ):
        return t.numel() // channels, channels, 1, run
    return None


def to_channel_runs(x: torch.Tensor, channel_dim: int, group: int) -> torch.Tensor:
    """``x`` copied channel-major as a flat block of padded runs (NOTE [channel groups])."""
    channels = x.shape[channel_dim]
    run = x.numel() // channels
    padded = padded_run(run, group)
    block = x.new_empty((channels, padded))
    moved = _channel_view(x, channel_dim)
    block[:, :run].view(moved.shape).copy_(moved)
    if padded > run:
        block[:, run:] = block[:, run - 1 : run]
    return block.view(-1)


def from_channel_runs(flat: torch.Tensor, out: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """Copies a block made by :func:`to_channel_runs` back into ``out``; returns ``out``."""
    moved = _channel_view(out, channel_dim)
    channels = moved.shape[0]
    run = out.numel() // channels
    moved.copy_(flat.view(channels, -1)[:, :run].view(moved.shape))
    return out


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """The storage block of a tensor built by :func:`empty_with_layout`, as a flat view."""
    return t.as_strided((t.numel(),), (1,))


def empty_with_layout(
    shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An uninitialised tensor with ``shape`` and ``stride`` (validated by :func:`check_layout`)."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def check_layout(shape: object, stride: object, owner: str) -> int:
    """Validates a container's ``shape`` and ``stride``; returns the number of elements."""
    if not isinstance(shape, torch.Size):
        raise TypeError(f"{owner}.shape must be a torch.Size, got {type(shape).__name__}")
    if not isinstance(stride, tuple) or len(stride) != len(shape):
        raise TypeError(
            f"{owner}.stride must be a tuple of {len(shape)} ints (one per dimension of "
            f"shape {tuple(shape)}); got {stride!r}"
        )
    if not all(type(st) is int and st >= 0 for st in stride):
        for st in stride:
            if integer(st, f"{owner}.stride entries") < 0:
                raise ValueError(f"{owner}.stride must not be negative; got {stride}")
        stride = tuple(operator.index(st) for st in stride)
    n = shape.numel()
    if n < 0 or any(size < 0 for size in shape):
        raise ValueError(f"{owner}.shape must not hold negative sizes; got {tuple(shape)}")
    if n and not _is_dense(shape, stride):
        raise ValueError(
            f"{owner}.stride {stride} does not lay shape {tuple(shape)} out densely without "
            f"overlap; use the strides of a contiguous or permuted tensor, e.g. "
            f"{contiguous_stride(shape)}"
        )
    return n
