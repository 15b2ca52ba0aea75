"""Per-group stochastic-rounding quantisation of float tensors to 1-8 bits.

The byte format and the random stream are defined once, in NOTE [storage and RNG invariants]
in ``csrc/common.h`` (summarised in the package README); ``reference.py`` restates them in torch.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._backend import DTYPE_CODES, launch
from ._checks import check_bits, check_group_size, check_seed, check_tensor
from ._payload import Payload

__all__ = ["FLOAT_DTYPES", "QuantizedTensor", "dequantize", "quantize"]

#: Input dtypes accepted by :func:`quantize`.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class QuantizedTensor(Payload):
    """A tensor compressed by :func:`quantize`; immutable, holds torch tensors on one device.

    Attributes:
        data: uint8, ceil(numel*bits/8) packed codes.
        lo: float32 per group, the group minimum (0 for lossless groups).
        scale: float32 per group, the step; NaN marks a group stored losslessly.
        nonfinite_groups: int64 indices of the lossless groups (empty almost always).
        nonfinite_values: their raw elements, shape (len(nonfinite_groups), group_size), in
            ``dtype``; a partial last group repeats its final element.
        bits: code width, 1..8.
        group_size: elements per group.
        shape: shape of the original tensor.
        dtype: dtype of the original tensor.
    """

    __slots__ = (
        "bits",
        "data",
        "dtype",
        "group_size",
        "lo",
        "nonfinite_groups",
        "nonfinite_values",
        "scale",
        "shape",
    )
    _BUFFERS = ("data", "lo", "scale", "nonfinite_groups", "nonfinite_values")

    data: torch.Tensor
    lo: torch.Tensor
    scale: torch.Tensor
    nonfinite_groups: torch.Tensor
    nonfinite_values: torch.Tensor
    bits: int
    group_size: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)


def element_index(groups: torch.Tensor, group_size: int, numel: int) -> torch.Tensor:
    """Flat element indices of ``groups``, shape (len(groups), group_size), clamped to numel-1."""
    offsets = torch.arange(group_size, device=groups.device)
    return (groups[:, None] * group_size + offsets).clamp_(max=max(numel - 1, 0))


def lossless_groups(
    flat: torch.Tensor, scale: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices and raw elements of the groups flagged by a NaN scale.

    On CUDA the ``nonzero`` here is the one host-device synchronisation of :func:`quantize`.
    """
    groups = torch.isnan(scale).nonzero().flatten()
    if groups.numel() == 0:
        return groups, flat.new_empty((0, group_size))
    return groups, flat[element_index(groups, group_size, flat.numel())]


def quantize(
    x: torch.Tensor, bits: int, *, group_size: int = 256, seed: int = 0
) -> QuantizedTensor:
    """Compresses ``x`` to ``bits`` bits per element with unbiased stochastic rounding.

    Each group of ``group_size`` consecutive elements (of the flattened tensor) is stored as
    ``bits``-bit codes plus a float32 minimum and step (8 bytes per group). The rounding noise
    is a pure function of ``(seed, element index)``: the same input and seed give the same
    bytes on any thread count and on CPU and CUDA. Non-contiguous inputs are copied with
    ``.contiguous()`` first. On CUDA the kernel runs on the current stream; the call then
    synchronises once, to find groups holding NaN/Inf (stored losslessly).

    Args:
        x: float32, float16 or bfloat16 tensor of any shape, on CPU or CUDA.
        bits: code width, 1..8.
        group_size: elements per group, a multiple of 8 in [8, 65536].
        seed: int in [0, 2**64); use a fresh seed per tensor and step.

    Returns:
        A :class:`QuantizedTensor`; :func:`dequantize` restores shape, dtype and device.

    Example:
        >>> import torch, gact_kernels
        >>> x = torch.randn(4, 1000)
        >>> q = gact_kernels.quantize(x, 2, seed=7)
        >>> q.nbytes  # 1000 packed bytes + 16 groups * 8 bytes of metadata
        1128
        >>> gact_kernels.dequantize(q).shape
        torch.Size([4, 1000])
    """
    check_tensor(x, "x", FLOAT_DTYPES)
    bits = check_bits(bits)
    group_size = check_group_size(group_size)
    seed = check_seed(seed)
    flat = x.detach().contiguous().view(-1)
    n = flat.numel()
    groups = -(-n // group_size)
    data = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=x.device)
    lo = torch.empty(groups, dtype=torch.float32, device=x.device)
    scale = torch.empty(groups, dtype=torch.float32, device=x.device)
    if n:
        launch(
            "quantize", x.device, flat.data_ptr(), DTYPE_CODES[x.dtype], n, group_size, bits,
            seed, data.data_ptr(), lo.data_ptr(), scale.data_ptr(),
        )  # fmt: skip
    bad_groups, bad_values = lossless_groups(flat, scale, group_size)
    return QuantizedTensor(
        data, lo, scale, bad_groups, bad_values, bits, group_size, x.shape, x.dtype
    )


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Decompresses ``q`` to a new tensor of its original shape, dtype and device.

    Asynchronous on CUDA (current stream, no synchronisation).

    Args:
        q: the result of :func:`quantize` (possibly moved with ``q.to(...)``).

    Returns:
        A contiguous tensor; groups with NaN/Inf come back bit-exact.

    Example:
        >>> import torch, gact_kernels
        >>> x = torch.full((300,), 1.5)
        >>> torch.equal(gact_kernels.dequantize(gact_kernels.quantize(x, 1)), x)
        True
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor, got {type(q).__name__}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = out.numel()
    if n:
        launch(
            "dequantize", q.device, q.data.data_ptr(), q.lo.data_ptr(), q.scale.data_ptr(), n,
            q.group_size, q.bits, DTYPE_CODES[q.dtype], out.data_ptr(),
        )  # fmt: skip
    if q.nonfinite_groups.numel():
        index = element_index(q.nonfinite_groups, q.group_size, n)
        out.view(-1)[index] = q.nonfinite_values
    return out
