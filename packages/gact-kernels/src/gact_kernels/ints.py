"""Lossless packing of integer tensors (max-pool indices, gather indices, labels, ...)."""

from __future__ import annotations

import dataclasses

import torch

from ._backend import DTYPE_CODES, launch
from ._checks import check_buffer, check_dtype, check_group_size, check_tensor
from ._compressed import Compressed
from ._layout import check_layout, empty_with_layout, flat_view, memory_order

__all__ = ["INT_DTYPES", "PackedInts", "pack_ints", "unpack_ints"]

#: Integer dtypes accepted by :func:`pack_ints`.
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

# The byte format is NOTE [storage and RNG invariants] ("Integer packing") in csrc/common.h;
# reference.py restates it in torch.


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class PackedInts(Compressed):
    """An integer tensor packed by :func:`pack_ints`; immutable, holds tensors on one device.

    Attributes:
        data: uint8, the groups' codes one after the other; group g takes
            ceil(elements_g * widths[g] / 8) bytes.
        mins: int64 per group, the group minimum.
        widths: uint8 per group, the bits per code (0..64; 0 for a constant group).
        group_size: elements per group (consecutive in memory).
        shape: shape of the original tensor.
        stride: strides of the restored tensor (the original's when it was dense).
        dtype: dtype of the original tensor.

    Example:
        >>> import torch, gact_kernels
        >>> p = gact_kernels.pack_ints(torch.arange(1000, 1256))
        >>> p.widths.tolist(), p.nbytes  # 256 codes of 8 bits + 8-byte minimum + 1-byte width
        ([8], 265)
    """

    __slots__ = ("data", "dtype", "group_size", "mins", "shape", "stride", "widths")
    _BUFFERS = ("data", "mins", "widths")

    data: torch.Tensor
    mins: torch.Tensor
    widths: torch.Tensor
    group_size: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype

    def _validate(self) -> None:
        check_group_size(self.group_size, "PackedInts.group_size")
        check_dtype(self.dtype, INT_DTYPES, "PackedInts.dtype")
        check_layout(self.shape, self.stride, "PackedInts")
        self._check_buffers()

    def _check_buffers(self) -> None:
        groups = -(-self.shape.numel() // self.group_size)
        device = getattr(self.data, "device", None)
        data = self.data
        size = data.shape[0] if isinstance(data, torch.Tensor) and data.dim() else 0
        check_buffer(data, "PackedInts.data", torch.uint8, (size,), device)  # any length
        check_buffer(self.mins, "PackedInts.mins", torch.int64, (groups,), device)
        check_buffer(self.widths, "PackedInts.widths", torch.uint8, (groups,), device)

    def _decompress(self) -> torch.Tensor:
        return unpack_ints(self)


def _group_starts(widths: torch.Tensor, n: int, group_size: int) -> torch.Tensor:
    """Byte offset of every group, then the total: int64, len(widths) + 1 entries."""
    counts = torch.full_like(widths, group_size, dtype=torch.int64)
    if n:
        counts[-1] = n - (len(widths) - 1) * group_size
    sizes = (counts * widths + 7) // 8
    return torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])


def pack_ints(x: torch.Tensor, *, group_size: int = 256) -> PackedInts:
    """Packs an integer tensor losslessly, each group in as few bits as its range needs.

    Per group of ``group_size`` elements (consecutive in memory) it stores the minimum (int64)
    and the width w in 0..64 bits that ``max - min`` needs, then every element as ``x - min``
    in w bits: indices into a 56x56 map, for example, need at most 12 bits instead of 64. A dense input
    (contiguous, channels-last, any permutation) is read in place and :func:`unpack_ints`
    restores its strides; other layouts are copied contiguous first. On CUDA the call
    synchronises once, to read the packed size (one 8-byte device-to-host copy).

    Args:
        x: dense uint8, int8, int16, int32 or int64 tensor of any shape, on CPU or CUDA.
        group_size: elements per group, a multiple of 8 in [8, 65536].

    Returns:
        A :class:`PackedInts`; :func:`unpack_ints` restores it bit for bit.

    Example:
        >>> import torch, gact_kernels
        >>> idx = torch.randint(0, 3136, (8, 64, 28, 28))
        >>> p = gact_kernels.pack_ints(idx)
        >>> round(idx.nbytes / p.nbytes, 1), torch.equal(gact_kernels.unpack_ints(p), idx)
        (5.2, True)
    """
    check_tensor(x, "x", INT_DTYPES)
    group_size = check_group_size(group_size)
    flat, stride = memory_order(x.detach())
    n = flat.numel()
    groups = -(-n // group_size)
    mins = torch.empty(groups, dtype=torch.int64, device=x.device)
    widths = torch.empty(groups, dtype=torch.uint8, device=x.device)
    code = DTYPE_CODES[x.dtype]
    if n:
        launch("int_params", x.device, flat.data_ptr(), code, n, group_size, mins.data_ptr(),
               widths.data_ptr())  # fmt: skip
    starts = _group_starts(widths, n, group_size)
    data = torch.empty(int(starts[-1]), dtype=torch.uint8, device=x.device)  # the one sync
    if data.numel():
        launch(
            "pack_ints", x.device, flat.data_ptr(), code, n, group_size, mins.data_ptr(),
            widths.data_ptr(), starts.data_ptr(), data.data_ptr(),
        )  # fmt: skip
    return PackedInts._built(
        data=data,
        mins=mins,
        widths=widths,
        group_size=group_size,
        shape=x.shape,
        stride=stride,
        dtype=x.dtype,
    )


def unpack_ints(p: PackedInts) -> torch.Tensor:
    """Restores the integer tensor packed in ``p``, bit for bit, with its strides and device.

    On CPU the widths are checked against the payload first (``ValueError`` if ``p`` was
    tampered with); on CUDA that would need a synchronisation, so a malformed group comes back
    as its minimum instead (the kernel never reads outside ``p.data``). Asynchronous on CUDA.

    Args:
        p: the result of :func:`pack_ints` (possibly moved with ``p.to(...)``).

    Returns:
        A new tensor equal to the packed one.

    Example:
        >>> import torch, gact_kernels
        >>> x = torch.tensor([[-5, 7], [2**62, 0]])
        >>> gact_kernels.unpack_ints(gact_kernels.pack_ints(x))
        tensor([[                 -5,                   7],
                [4611686018427387904,                   0]])
    """
    if not isinstance(p, PackedInts):
        raise TypeError(f"p must be a PackedInts, got {type(p).__name__}")
    p._check_buffers()
    out = empty_with_layout(p.shape, p.stride, p.dtype, p.device)
    flat = flat_view(out)
    n = flat.numel()
    starts = _group_starts(p.widths, n, p.group_size)
    if p.device.type == "cpu":
        if n and int(p.widths.max()) > 64:
            raise ValueError(f"PackedInts.widths must lie in 0..64; got {int(p.widths.max())}")
        if int(starts[-1]) != p.data.numel():
            raise ValueError(
                f"PackedInts.data holds {p.data.numel()} bytes but the widths describe "
                f"{int(starts[-1])}; the container was not built by pack_ints"
            )
    if n:
        launch(
            "unpack_ints", p.device, p.data.data_ptr(), p.data.numel(), p.mins.data_ptr(),
            p.widths.data_ptr(), starts.data_ptr(), n, p.group_size, DTYPE_CODES[p.dtype],
            flat.data_ptr(),
        )  # fmt: skip
    return out
