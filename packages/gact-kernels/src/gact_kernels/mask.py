"""Lossless 1-bit packing of bool (and 0/1 uint8) masks, e.g. dropout or ReLU masks."""

from __future__ import annotations

import dataclasses

import torch

from ._backend import launch
from ._checks import check_buffer, check_dtype, check_tensor
from ._compressed import Compressed
from ._layout import check_layout, empty_with_layout, flat_view, memory_order

__all__ = ["MASK_DTYPES", "PackedMask", "pack_mask", "unpack_mask"]

#: Mask dtypes accepted by :func:`pack_mask`.
MASK_DTYPES = (torch.bool, torch.uint8)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class PackedMask(Compressed):
    """A mask packed by :func:`pack_mask`: element e (in memory order) is bit e % 8 of byte e // 8.

    Attributes:
        data: uint8, ceil(numel/8) bytes.
        shape: shape of the original mask.
        stride: strides of the restored mask (the original's when it was dense).
        dtype: ``torch.bool`` or ``torch.uint8``.

    Example:
        >>> import torch, gact_kernels
        >>> gact_kernels.pack_mask(torch.ones(2, 9, dtype=torch.bool))
        PackedMask(shape=torch.Size([2, 9]), stride=(9, 1), dtype=torch.bool, device=cpu, nbytes=3)
    """

    __slots__ = ("data", "dtype", "shape", "stride")
    _BUFFERS = ("data",)

    data: torch.Tensor
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    def _validate(self) -> None:
        check_dtype(self.dtype, MASK_DTYPES, "PackedMask.dtype")
        check_layout(self.shape, self.stride, "PackedMask")
        self._check_buffers()

    def _check_buffers(self) -> None:
        n = self.shape.numel()
        device = getattr(self.data, "device", None)
        check_buffer(self.data, "PackedMask.data", torch.uint8, ((n + 7) // 8,), device)

    def _decompress(self) -> torch.Tensor:
        return unpack_mask(self)


def pack_mask(mask: torch.Tensor) -> PackedMask:
    """Packs a bool or 0/1 uint8 tensor into 1 bit per element, losslessly.

    A dense mask (contiguous, channels-last, any permutation) is read in place and comes back
    with its strides; other layouts are copied contiguous first. A uint8 mask must hold only
    0 and 1: on CPU other values raise ``ValueError``; on CUDA they are not checked (that would
    need a synchronisation) and come back as 1. Asynchronous on CUDA.

    Args:
        mask: dense bool or uint8 tensor of any shape, on CPU or CUDA.

    Returns:
        A :class:`PackedMask`; :func:`unpack_mask` restores shape, strides, dtype and device.

    Example:
        >>> import torch, gact_kernels
        >>> m = torch.rand(3, 100) > 0.5
        >>> p = gact_kernels.pack_mask(m)
        >>> p.nbytes, torch.equal(gact_kernels.unpack_mask(p), m)
        (38, True)
    """
    check_tensor(mask, "mask", MASK_DTYPES)
    flat, stride = memory_order(mask.detach())
    n = flat.numel()
    data = torch.empty((n + 7) // 8, dtype=torch.uint8, device=mask.device)
    if n:
        invalid = launch("pack_mask", mask.device, flat.data_ptr(), n, data.data_ptr())
        if invalid:
            raise ValueError("mask: a uint8 mask must hold only 0 and 1 (use a bool mask)")
    return PackedMask._built(data=data, shape=mask.shape, stride=stride, dtype=mask.dtype)


def unpack_mask(p: PackedMask) -> torch.Tensor:
    """Restores the mask packed in ``p`` with its shape, strides, dtype and device.

    Args:
        p: the result of :func:`pack_mask` (possibly moved with ``p.to(...)``).

    Returns:
        A new bool or uint8 tensor.

    Example:
        >>> import torch, gact_kernels
        >>> m = torch.tensor([[1, 0, 1]], dtype=torch.uint8)
        >>> gact_kernels.unpack_mask(gact_kernels.pack_mask(m))
        tensor([[1, 0, 1]], dtype=torch.uint8)
    """
    if not isinstance(p, PackedMask):
        raise TypeError(f"p must be a PackedMask, got {type(p).__name__}")
    p._check_buffers()
    out = empty_with_layout(p.shape, p.stride, p.dtype, p.device)
    flat = flat_view(out)
    n = flat.numel()
    if n:
        launch("unpack_mask", p.device, p.data.data_ptr(), n, flat.data_ptr())
    return out
