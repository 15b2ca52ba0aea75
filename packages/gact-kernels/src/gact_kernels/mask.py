"""Lossless 1-bit packing of bool (and 0/1 uint8) masks, e.g. dropout or ReLU masks."""

from __future__ import annotations

import dataclasses

import torch

from ._backend import launch
from ._checks import check_tensor
from ._payload import Payload

__all__ = ["MASK_DTYPES", "PackedMask", "pack_mask", "unpack_mask"]

#: Mask dtypes accepted by :func:`pack_mask`.
MASK_DTYPES = (torch.bool, torch.uint8)


@dataclasses.dataclass(frozen=True)
class PackedMask(Payload):
    """A mask packed by :func:`pack_mask`: element e is bit e % 8 of byte e // 8.

    Attributes:
        data: uint8, ceil(numel/8) bytes.
        shape: shape of the original mask.
        dtype: ``torch.bool`` or ``torch.uint8``.
    """

    __slots__ = ("data", "dtype", "shape")
    _BUFFERS = ("data",)

    data: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype


def pack_mask(mask: torch.Tensor) -> PackedMask:
    """Packs a bool or 0/1 uint8 tensor into 1 bit per element, losslessly.

    Non-contiguous masks are copied with ``.contiguous()`` first. A uint8 mask must hold only
    0 and 1: on CPU other values raise ``ValueError``; on CUDA they are not checked (that would
    need a synchronisation) and come back as 1. Asynchronous on CUDA.

    Args:
        mask: bool or uint8 tensor of any shape, on CPU or CUDA.

    Returns:
        A :class:`PackedMask`; :func:`unpack_mask` restores shape, dtype and device.

    Example:
        >>> import torch, gact_kernels
        >>> m = torch.rand(3, 100) > 0.5
        >>> p = gact_kernels.pack_mask(m)
        >>> p.nbytes, torch.equal(gact_kernels.unpack_mask(p), m)
        (38, True)
    """
    check_tensor(mask, "mask", MASK_DTYPES)
    flat = mask.detach().contiguous().view(-1)
    n = flat.numel()
    data = torch.empty((n + 7) // 8, dtype=torch.uint8, device=mask.device)
    if n:
        invalid = launch("pack_mask", mask.device, flat.data_ptr(), n, data.data_ptr())
        if invalid:
            raise ValueError("mask: a uint8 mask must hold only 0 and 1 (use a bool mask)")
    return PackedMask(data, mask.shape, mask.dtype)


def unpack_mask(p: PackedMask) -> torch.Tensor:
    """Restores the mask packed in ``p`` with its shape, dtype and device.

    Args:
        p: the result of :func:`pack_mask` (possibly moved with ``p.to(...)``).

    Returns:
        A new contiguous bool or uint8 tensor.

    Example:
        >>> import torch, gact_kernels
        >>> m = torch.tensor([[1, 0, 1]], dtype=torch.uint8)
        >>> gact_kernels.unpack_mask(gact_kernels.pack_mask(m))
        tensor([[1, 0, 1]], dtype=torch.uint8)
    """
    if not isinstance(p, PackedMask):
        raise TypeError(f"p must be a PackedMask, got {type(p).__name__}")
    out = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    n = out.numel()
    if n:
        launch("unpack_mask", p.device, p.data.data_ptr(), n, out.data_ptr())
    return out
