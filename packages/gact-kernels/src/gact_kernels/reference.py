"""Pure-torch references of the kernels, for tests and benchmarks.

:func:`reference_quantize`, :func:`reference_dequantize`, :func:`reference_pack_ints` and
:func:`reference_unpack_ints` have the contracts of the functions they shadow and, on CPU,
produce the same bytes and values. They are slow and memory hungry (several int64 temporaries
per element, 64 per element for integers).

Example:
    >>> import torch, gact_kernels
    >>> x = torch.randn(1000).bfloat16()
    >>> q = gact_kernels.quantize(x, 3, seed=5)
    >>> q == reference_quantize(x, 3, seed=5)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_bits, check_group_size, check_seed, check_tensor, check_zero_exact
from ._layout import empty_with_layout, flat_view, from_channel_runs, memory_order
from .ints import INT_DTYPES, PackedInts
from .quantize import FLOAT_DTYPES, QuantizedTensor

__all__ = [
    "hash32",
    "reference_dequantize",
    "reference_pack_ints",
    "reference_quantize",
    "reference_rotate",
    "reference_unpack_ints",
    "reference_unrotate",
    "round_stochastic",
]

# Restates NOTE [storage and RNG invariants] (csrc/common.h) with plain tensor operations, one
# IEEE fp32 operation at a time; uint32 and uint64 arithmetic is done in int64 tensors, masked
# to 32 bits after every step (64-bit values as two 32-bit halves).

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LOW_MUL = 0x9E3779B1
_HIGH_MUL = 0x85EBCA77
_FIN1 = 0x7FEB352D
_FIN2 = 0x846CA68B
_FLOAT_MAX = torch.finfo(torch.float32).max


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def hash32(seed: int, index: torch.Tensor, *, stream: str = "quantize") -> torch.Tensor:
    """The 32 random bits (int64 in [0, 2**32)) of the elements at int64 ``index``.

    Args:
        seed: the seed given to ``quantize``.
        index: element indices (memory order).
        stream: ``"quantize"`` (rounding noise u = (h >> 8) * 2**-24), ``"dequantize"``
            (stochastic rounding of float16/bfloat16 outputs) or ``"rotation"`` (the same, of
            ``unrotate``'s outputs).

    Example:
        >>> import torch
        >>> h = hash32(0, torch.arange(4))
        >>> bool(((h >= 0) & (h < 2**32)).all())
        True
    """
    key = _mix64((seed + _GAMMA) & _MASK64)
    if stream in ("dequantize", "rotation"):
        key = _mix64(key)
        if stream == "rotation":
            key = _mix64(key)
    elif stream != "quantize":
        raise ValueError(f"stream must be 'quantize', 'dequantize' or 'rotation'; got {stream!r}")
    k0, k1 = key & _MASK32, key >> 32
    high = ((index >> 32) * _HIGH_MUL + k1) & _MASK32
    h = (((((index & _MASK32) * _LOW_MUL) & _MASK32) ^ high) + k0) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _FIN1) & _MASK32
    h = h ^ (h >> 15)
    h = (h * _FIN2) & _MASK32
    return h ^ (h >> 16)


def _per_element(v: torch.Tensor, group_size: int, n: int) -> torch.Tensor:
    return v.repeat_interleave(group_size)[:n]


def _grouped(v: torch.Tensor, group_size: int) -> torch.Tensor:
    """(groups, group_size) view of v, the last group padded with its final element."""
    n = v.numel()
    return F.pad(v[None], (0, -n % group_size), mode="replicate")[0].view(-1, group_size)


def _lossless(
    flat: torch.Tensor, scale: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the flagged groups and their elements (a partial group repeats its last)."""
    groups = torch.isnan(scale).nonzero().flatten()
    if not flat.numel():
        return groups, flat.new_empty((0, group_size))
    return groups, _grouped(flat, group_size)[groups]


def _tiny(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The first positive level of the zero-exact grid, a float32 scalar tensor."""
    return torch.tensor(torch.finfo(dtype).tiny, dtype=torch.float32, device=device)


def reference_quantize(
    x: torch.Tensor,
    bits: int,
    *,
    group_size: int = 256,
    seed: int = 0,
    zero_exact: bool = False,
) -> QuantizedTensor:
    """Same contract and, on CPU, the same bytes as :func:`gact_kernels.quantize`."""
    check_tensor(x, "x", FLOAT_DTYPES)
    bits, group_size, seed = check_bits(bits), check_group_size(group_size), check_seed(seed)
    zero_exact = check_zero_exact(zero_exact, bits)
    flat, stride = memory_order(x.detach())
    flat = flat.view(-1)
    n = flat.numel()
    xf = flat.float()
    if n:
        g = _grouped(xf, group_size)
        mn, mx, bad = g.amin(1), g.amax(1), ~torch.isfinite(g).all(1)
    else:
        mn = mx = xf.new_empty(0)
        bad = torch.zeros(0, dtype=torch.bool, device=x.device)
    lo = mn + 0.0  # maps -0 to +0
    hi = mx + 0.0
    span = hi - lo
    levels = torch.full_like(span, float(2**bits - 1))
    scale = span / levels
    flagged = bad | ~torch.isfinite(span) | ((span > 0) & (scale < 2.0**-126))
    # The zero-exact grid: groups not flagged whose lo is +0 (bit pattern 0).
    exact = (lo.view(torch.int32) == 0) & ~flagged & zero_exact
    tiny = _tiny(x.dtype, x.device)
    step = (hi - tiny).clamp(min=0.0) / (levels - 1.0)
    scale = torch.where(exact, step, scale)
    scale = torch.where(flagged, torch.full_like(span, float("nan")), scale)
    lo = torch.where(flagged, torch.zeros_like(lo), lo)

    lo_e, scale_e = _per_element(lo, group_size, n), _per_element(scale, group_size, n)
    u = (hash32(seed, torch.arange(n, device=x.device)) >> 8).to(torch.float32) * 2.0**-24
    t = torch.minimum((xf - lo_e) / scale_e + u, levels[:1].expand(n))
    q = torch.where(scale_e > 0, t, torch.zeros_like(t)).to(torch.int64)  # truncation = floor
    if zero_exact:
        exact_e = _per_element(exact, group_size, n)
        d = (xf - tiny).clamp(min=0.0)
        divisor = torch.where(scale_e > 0, scale_e, torch.ones_like(scale_e))
        k = torch.minimum(d / divisor + u, levels[:1].expand(n) - 1.0).to(torch.int64)
        q = torch.where(exact_e, torch.where(xf > 0, k + 1, 0), q)

    chunks = F.pad(q, (0, -n % 8)).view(-1, 8)
    word = chunks[:, 0]
    for j in range(1, 8):
        word = word | (chunks[:, j] << (j * bits))
    shifts = torch.arange(0, 8 * bits, 8, device=x.device)
    data = ((word[:, None] >> shifts) & 0xFF).to(torch.uint8).flatten()[: (n * bits + 7) // 8]
    groups, values = _lossless(flat, scale, group_size)
    return QuantizedTensor(
        data, lo, scale, groups, values,
        bits=bits, group_size=group_size, seed=seed, shape=x.shape, stride=stride, dtype=x.dtype,
        zero_exact=zero_exact, channel_dim=None,
    )  # fmt: skip


def _to_16_bits(bits16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    signed = bits16 - ((bits16 >> 15) << 16)  # uint16 pattern as int16 value
    return signed.to(torch.int16).view(dtype)


def round_stochastic(v: torch.Tensor, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``v`` rounded stochastically to ``dtype`` (float16 or bfloat16) with random words
    ``h`` (int64 in [0, 2**32)), by the rule of NOTE [storage and RNG invariants].

    Example:
        >>> import torch
        >>> v = torch.full((4,), 1.00390625)  # halfway between bfloat16 1.0 and 1.0078125
        >>> h = torch.tensor([0, 2**31 - 1, 2**31, 2**32 - 1])
        >>> round_stochastic(v, h, torch.bfloat16).tolist()
        [1.0, 1.0, 1.0078125, 1.0078125]
    """
    x = v.view(torch.int32).to(torch.int64) & _MASK32
    a, sign = x & 0x7FFFFFFF, (x >> 16) & 0x8000
    if dtype == torch.bfloat16:
        r = ((a + (h >> 16)) >> 16).clamp(max=0x7F7F)
        r = torch.where(a > 0x7F800000, 0x7FC0, r)
        return _to_16_bits(sign | r, dtype)
    nrm = ((a - (112 << 23) + (h >> 19)) >> 13).clamp(max=0x7BFF)
    subnormal = a < (113 << 23)
    t = torch.where(subnormal, a, 0).to(torch.int32).view(torch.float32) * 2.0**24
    k = t.to(torch.int64)
    frac32 = ((t - k.to(torch.float32)) * 2.0**32).to(torch.int64)
    r = torch.where(subnormal, k + (h + frac32 > _MASK32).to(torch.int64), nrm)
    r = torch.where(a > 0x7F800000, 0x7E00, r)
    return _to_16_bits(sign | r, dtype)


def reference_dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Same result as :func:`gact_kernels.dequantize`, in plain torch."""
    n, bits = q.stored_numel, q.bits
    chunks = -(-n // 8)
    raw = F.pad(q.data.to(torch.int64), (0, chunks * bits - q.data.numel())).view(chunks, bits)
    word = raw[:, 0]
    for k in range(1, bits):
        word = word | (raw[:, k] << (8 * k))
    shifts = torch.arange(0, 8 * bits, bits, device=q.data.device)
    codes = ((word[:, None] >> shifts) & (2**bits - 1)).flatten()[:n]
    lo_e = _per_element(q.lo, q.group_size, n)
    scale_e = _per_element(q.scale, q.group_size, n)
    v = (lo_e + codes.to(torch.float32) * scale_e).clamp(-_FLOAT_MAX, _FLOAT_MAX)
    if q.zero_exact:
        exact_e = _per_element(q.lo.view(torch.int32) == 0, q.group_size, n)
        tiny = _tiny(q.dtype, v.device)
        v_exact = (tiny + (codes - 1).to(torch.float32) * scale_e).clamp(max=_FLOAT_MAX)
        v_exact = torch.where(codes == 0, torch.zeros_like(v), v_exact)
        v = torch.where(exact_e, v_exact, v)
    if q.dtype != torch.float32:
        h = hash32(q.seed, torch.arange(n, device=v.device), stream="dequantize")
        v = round_stochastic(v, h, q.dtype)
    out = empty_with_layout(q.shape, q.stride, q.dtype, q.device)
    flat = flat_view(out) if q.channel_dim is None else v.to(q.dtype)
    flat.copy_(v)
    if q.lossless_groups.numel():
        offsets = torch.arange(q.group_size, device=q.lossless_groups.device)
        index = q.lossless_groups[:, None] * q.group_size + offsets
        flat[index.clamp(0, n - 1)] = q.lossless_values
    return out if q.channel_dim is None else from_channel_runs(flat, out, q.channel_dim)


def _halves(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high 32 bits of int64 v, each as a non-negative int64."""
    return v & _MASK32, (v >> 32) & _MASK32


def _bit_width(v: torch.Tensor) -> torch.Tensor:
    """Bit width of 32-bit values (int64 in [0, 2**32))."""
    powers = 2 ** torch.arange(32, dtype=torch.int64, device=v.device)
    return (v[..., None] >= powers).sum(-1)


def _ints_layout(widths: torch.Tensor, n: int, group_size: int) -> tuple:
    counts = torch.full(widths.shape, group_size, dtype=torch.int64)
    counts[-1:] = n - (len(widths) - 1) * group_size
    sizes = (counts * widths + 7) // 8
    return torch.cumsum(sizes, 0) - sizes, int(sizes.sum())


def _bit_positions(widths: torch.Tensor, starts: torch.Tensor, n: int, group_size: int) -> tuple:
    """(n, 64) stream position of each code bit, and which of the 64 bits exist (b < w)."""
    e = torch.arange(n)
    g = e // group_size
    b = torch.arange(64)
    w = widths[g].to(torch.int64)[:, None]
    position = starts[g][:, None] * 8 + (e - g * group_size)[:, None] * w + b
    return position, b < w


def reference_pack_ints(x: torch.Tensor, *, group_size: int = 256) -> PackedInts:
    """Same contract and, on CPU, the same bytes as :func:`gact_kernels.pack_ints`."""
    check_tensor(x, "x", INT_DTYPES)
    group_size = check_group_size(group_size)
    flat, stride = memory_order(x.detach().cpu())
    flat = flat.view(-1)
    n = flat.numel()
    v = flat.to(torch.int64)
    grouped = _grouped(v, group_size) if n else v.view(0, group_size)
    mins, maxs = grouped.amin(1), grouped.amax(1)
    d_lo, d_hi = _sub64(_halves(maxs), _halves(mins))
    widths = torch.where(d_hi > 0, 32 + _bit_width(d_hi), _bit_width(d_lo))
    starts, total = _ints_layout(widths, n, group_size)
    c_lo, c_hi = _sub64(_halves(v), _halves(_per_element(mins, group_size, n)))
    b = torch.arange(64)
    bits = torch.where(b < 32, c_lo[:, None] >> (b % 32), c_hi[:, None] >> (b % 32)) & 1
    position, exists = _bit_positions(widths, starts, n, group_size)
    stream = torch.zeros(total * 8, dtype=torch.int64)
    stream[position[exists]] = bits[exists]
    data = (stream.view(-1, 8) << torch.arange(8)).sum(1).to(torch.uint8)
    return PackedInts(
        data, mins, widths.to(torch.uint8),
        group_size=group_size, shape=x.shape, stride=stride, dtype=x.dtype,
    ).to(x.device)  # fmt: skip


def _sub64(a: tuple, b: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(a - b) mod 2**64 on (low, high) halves."""
    lo = a[0] - b[0]
    borrow = (lo < 0).to(torch.int64)
    return lo + borrow * 2**32, (a[1] - b[1] - borrow) & _MASK32


def reference_unpack_ints(p: PackedInts) -> torch.Tensor:
    """Same result as :func:`gact_kernels.unpack_ints`, in plain torch."""
    n, cpu = p.shape.numel(), p.to("cpu")
    widths = cpu.widths.to(torch.int64)
    starts, _ = _ints_layout(widths, n, p.group_size)
    stream = ((cpu.data.to(torch.int64)[:, None] >> torch.arange(8)) & 1).flatten()
    position, exists = _bit_positions(widths, starts, n, p.group_size)
    bits = torch.zeros(n, 64, dtype=torch.int64)
    bits[exists] = stream[position[exists]]
    weights = 2 ** (torch.arange(64) % 32)
    c_lo, c_hi = (bits[:, :32] * weights[:32]).sum(1), (bits[:, 32:] * weights[32:]).sum(1)
    m_lo, m_hi = _halves(_per_element(cpu.mins, p.group_size, n))
    lo = c_lo + m_lo
    hi = (c_hi + m_hi + (lo >> 32)) & _MASK32
    halves = torch.stack([lo & _MASK32, hi], -1)
    value = (halves - ((halves >> 31) << 32)).to(torch.int32).view(torch.int64).flatten()
    out = empty_with_layout(p.shape, p.stride, p.dtype, torch.device("cpu"))
    flat_view(out).copy_(value.to(p.dtype))
    return out.to(p.device)


_SIGN_SEED = 0x6AC7


def _rotation_negates(block: int, device: torch.device) -> torch.Tensor:
    return (hash32(_SIGN_SEED, torch.arange(block, device=device)) >> 31).bool()


def _butterflies(blocks: torch.Tensor) -> torch.Tensor:
    """The spec's butterflies on each row of float32 ``blocks``, stage by stage (h = 1, 2, ...)."""
    count, block = blocks.shape
    y = blocks
    h = 1
    while h < block:
        pairs = y.reshape(count, block // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(count, block)
        h *= 2
    return y


def reference_rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """Same result as :func:`gact_kernels.rotate` on a contiguous ``x``, in plain torch."""
    flat = x.reshape(-1).float()
    whole = flat.numel() - flat.numel() % block
    out = flat.clone()
    head = flat[:whole].view(-1, block)
    out[:whole] = _butterflies(torch.where(_rotation_negates(block, x.device), -head, head)).view(
        -1
    )
    return out.view(x.shape)


def reference_unrotate(y: torch.Tensor, block: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Same result as :func:`gact_kernels.unrotate` on a contiguous ``y``, in plain torch."""
    flat = y.reshape(-1)
    whole = flat.numel() - flat.numel() % block
    out = flat.clone()
    v = _butterflies(flat[:whole].view(-1, block)) * (1.0 / block)
    out[:whole] = torch.where(_rotation_negates(block, y.device), -v, v).view(-1)
    if dtype != torch.float32:
        h = hash32(seed, torch.arange(flat.numel(), device=y.device), stream="rotation")
        out = round_stochastic(out, h, dtype)
    return out.view(y.shape)
