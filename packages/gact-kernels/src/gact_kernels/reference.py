"""Pure-torch reference of :func:`gact_kernels.quantize` / :func:`gact_kernels.dequantize`.

Restates NOTE [storage and RNG invariants] (``csrc/common.h``) with plain tensor operations,
one IEEE fp32 operation at a time, so on CPU it produces the same bytes as the kernels. It is
slow and memory hungry (several int64 temporaries per element): for tests and benchmarks only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_bits, check_group_size, check_seed, check_tensor
from .quantize import FLOAT_DTYPES, QuantizedTensor, element_index, lossless_groups

__all__ = ["reference_dequantize", "reference_quantize", "uniform24"]

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LOW_MUL = 0x9E3779B1
_HIGH_MUL = 0x85EBCA77
_FIN1 = 0x7FEB352D
_FIN2 = 0x846CA68B


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def uniform24(seed: int, index: torch.Tensor) -> torch.Tensor:
    """The rounding noise u in [0, 1) (float32, 24 random bits) for int64 element ``index``.

    The uint32 arithmetic is done in int64 tensors and masked to 32 bits after each step.

    Example:
        >>> import torch
        >>> u = uniform24(0, torch.arange(4))
        >>> bool(((u >= 0) & (u < 1)).all())
        True
    """
    key = _mix64((seed + _GAMMA) & _MASK64)
    k0, k1 = key & _MASK32, key >> 32
    high = ((index >> 32) * _HIGH_MUL + k1) & _MASK32
    h = (((((index & _MASK32) * _LOW_MUL) & _MASK32) ^ high) + k0) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _FIN1) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _FIN2) & _MASK32
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * 2.0**-24


def _per_element(v: torch.Tensor, group_size: int, n: int) -> torch.Tensor:
    return v.repeat_interleave(group_size)[:n]


def reference_quantize(
    x: torch.Tensor, bits: int, *, group_size: int = 256, seed: int = 0
) -> QuantizedTensor:
    """Same contract and, on CPU, the same bytes as :func:`gact_kernels.quantize`.

    Example:
        >>> import torch, gact_kernels
        >>> x = torch.randn(1000)
        >>> a, b = reference_quantize(x, 3, seed=1), gact_kernels.quantize(x, 3, seed=1)
        >>> torch.equal(a.data, b.data)
        True
    """
    check_tensor(x, "x", FLOAT_DTYPES)
    bits, group_size, seed = check_bits(bits), check_group_size(group_size), check_seed(seed)
    flat = x.detach().contiguous().view(-1)
    n = flat.numel()
    groups = -(-n // group_size)
    xf = flat.float()
    pad = (0, groups * group_size - n)
    mn = F.pad(xf, pad, value=float("inf")).view(groups, group_size).amin(1)
    mx = F.pad(xf, pad, value=float("-inf")).view(groups, group_size).amax(1)
    bad = ~torch.isfinite(F.pad(xf, pad)).view(groups, group_size).all(1)
    lo = mn + 0.0  # maps -0 to +0
    span = (mx + 0.0) - lo
    levels = torch.full_like(span, float(2**bits - 1))
    flagged = bad | ~torch.isfinite(span)
    scale = torch.where(flagged, torch.full_like(span, float("nan")), span / levels)
    lo = torch.where(flagged, torch.zeros_like(lo), lo)

    lo_e, scale_e = _per_element(lo, group_size, n), _per_element(scale, group_size, n)
    u = uniform24(seed, torch.arange(n, device=x.device))
    t = torch.minimum((xf - lo_e) / scale_e + u, levels[:1].expand(n))
    q = torch.where(scale_e > 0, t, torch.zeros_like(t)).to(torch.int64)  # truncation = floor

    chunks = F.pad(q, (0, -n % 8)).view(-1, 8)
    word = chunks[:, 0]
    for j in range(1, 8):
        word = word | (chunks[:, j] << (j * bits))
    shifts = torch.arange(0, 8 * bits, 8, device=x.device)
    data = ((word[:, None] >> shifts) & 0xFF).to(torch.uint8).flatten()[: (n * bits + 7) // 8]
    bad_groups, bad_values = lossless_groups(flat, scale, group_size)
    return QuantizedTensor(
        data, lo, scale, bad_groups, bad_values, bits, group_size, x.shape, x.dtype
    )


def reference_dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Same result as :func:`gact_kernels.dequantize`, in plain torch.

    Example:
        >>> import torch
        >>> x = torch.randn(100)
        >>> reference_dequantize(reference_quantize(x, 8)).shape
        torch.Size([100])
    """
    n, bits = q.numel, q.bits
    chunks = -(-n // 8)
    raw = F.pad(q.data.to(torch.int64), (0, chunks * bits - q.data.numel())).view(chunks, bits)
    word = raw[:, 0]
    for k in range(1, bits):
        word = word | (raw[:, k] << (8 * k))
    shifts = torch.arange(0, 8 * bits, bits, device=q.data.device)
    codes = ((word[:, None] >> shifts) & (2**bits - 1)).flatten()[:n]
    lo_e = _per_element(q.lo, q.group_size, n)
    scale_e = _per_element(q.scale, q.group_size, n)
    out = (lo_e + codes.to(torch.float32) * scale_e).to(q.dtype)
    if q.nonfinite_groups.numel():
        out[element_index(q.nonfinite_groups, q.group_size, n)] = q.nonfinite_values
    return out.view(q.shape)
