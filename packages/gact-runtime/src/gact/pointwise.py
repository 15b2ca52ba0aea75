"""Derivative tables: few-bit storage of GELU and SiLU inputs (Few-bit backward, ICML 2022)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import gact_kernels
import gact_policy
import torch

__all__ = [
    "DERIVATIVES",
    "LOOKUP_CHUNK",
    "LOOKUP_PIECES",
    "MAX_TABLE_BITS",
    "REJUDGE_STEPS",
    "SECOND_DERIVATIVES",
    "DerivativeTable",
    "derivative_table",
    "table_is_better",
]

# NOTE [Derivative tables]
# The backward of GELU and SiLU reads the saved input x only through f'(x). Quantizing x at b bits
# gives f'(x^), with variance and, f' being nonlinear, a bias. A derivative table stores instead
# which of 2**b intervals of x each element falls in (b bits, packed with gact_kernels.pack_ints)
# and, per interval, the value c_k that best approximates f' over it: the best piecewise-constant
# f' for an N(0, 1) input (gact_policy.fit_piecewise_constant over 8192 quantiles). At unpack the
# table gives back, per element, a representative input r_k of its interval with f'(r_k) = c_k,
# so autograd's own GeluBackward/SiluBackward computes g * c_k. Measured on the char-GPT example's
# GELU inputs (BENCHMARKS.md, "Few-bit derivatives"), its error is 3-26x below the quantized
# input's at 1-4 bits. Rules that keep this exact where it must be:
# - only the save of the call's own input, made during the call (DecisionMode publishes its id),
#   is stored so; that save is never shared with another op's save of the same tensor (the
#   live table skips it), and an unpack by any node but the function's backward raises;
# - only at widths <= MAX_TABLE_BITS, never while probes run (the estimator measures the
#   quantized error, which the table then undercuts), and only where a sample of whole groups
#   says the table's squared error is below the expected error of stochastic rounding (a narrow
#   range, which per-group quantization resolves finely, keeps quantization). That judgment is
#   made per save-site key, at its first save, whenever its width changes and then every
#   REJUDGE_STEPS steps, not per save: it costs several times a small tensor's whole save
#   (about 150 us against 30 us at 2,048 elements), and a site's input distribution drifts over
#   tens of steps, not between the saves of one step;
# - a second-order backward (create_graph=True) differentiates f' at r_k, not at x: it sees a
#   piecewise-constant f', as Few-bit backward does (README, Known limits).
MAX_TABLE_BITS = 4
REJUDGE_STEPS = 50
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_C = math.sqrt(2.0 / math.pi)


def _gelu_prime(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(x * _SQRT1_2)) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _gelu_tanh_prime(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_TANH_C * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _TANH_C * (1.0 + 3 * 0.044715 * x * x)


def _silu_prime(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _gelu_second(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) * _INV_SQRT_2PI * (2.0 - x * x)


def _gelu_tanh_second(x: torch.Tensor) -> torch.Tensor:
    inner = _TANH_C * (1.0 + 3 * 0.044715 * x * x)  # u' of u = c (x + 0.044715 x^3)
    t = torch.tanh(_TANH_C * (x + 0.044715 * x**3))
    return (1.0 - t * t) * (inner - x * t * inner * inner + 3 * 0.044715 * _TANH_C * x * x)


def _silu_second(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s))


#: function -> (its derivative, the class name of its backward node without the version digit)
DERIVATIVES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "gelu": (_gelu_prime, "GeluBackward"),
    "gelu_tanh": (_gelu_tanh_prime, "GeluBackward"),
    "silu": (_silu_prime, "SiluBackward"),
}

#: function -> its second derivative (NOTE [Measured pointwise inputs] in measured_pointwise.py)
SECOND_DERIVATIVES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu_second,
    "gelu_tanh": _gelu_tanh_second,
    "silu": _silu_second,
}


LOOKUP_CHUNK = 1 << 16  # codes a table's values look up at once; more go in
LOOKUP_PIECES = 8  # this many pieces (``DerivativeTable.values``)


@dataclass(frozen=True, eq=False)
class DerivativeTable:
    """The intervals of a pointwise function's input and the derivative each one stands for.

    Args:
        function: a key of ``DERIVATIVES``.
        bits: bits per element of the codes (``len(levels) <= 2**bits``).
        bounds: inner interval boundaries, increasing (float64): code ``k`` is
            ``bounds[k-1] < x <= bounds[k]``.
        levels: the derivative that stands for each interval (float64).
        inputs: a representative input per interval, ``f'(inputs[k]) == levels[k]`` to 1e-6.
    """

    function: str
    bits: int
    bounds: torch.Tensor
    levels: torch.Tensor
    inputs: torch.Tensor

    @property
    def node(self) -> str:
        """The backward node family allowed to unpack a save stored with this table."""
        return DERIVATIVES[self.function][1]

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """The interval of each element of ``x``, as uint8 (same shape)."""
        bounds = _moved(self.function, self.bits, "bounds", x.device, x.dtype)
        if x.dtype in gact_kernels.FLOAT_DTYPES:  # torch.bucketize's codes, 20x faster on CPU
            return gact_kernels.bucketize(x, bounds)
        return torch.bucketize(x, bounds).to(torch.uint8)

    def values(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The representative inputs of ``codes``, in ``dtype`` (same shape, contiguous)."""
        inputs = _moved(self.function, self.bits, "inputs", codes.device, dtype)
        flat = codes.reshape(-1)
        numel = flat.numel()
        if numel <= LOOKUP_CHUNK:
            # int32 indices: 3-7x faster than indexing with int64 ones on the CPU, same values
            return inputs.index_select(0, flat.int()).view(codes.shape)
        # in LOOKUP_PIECES pieces: an int32 copy of every code would hold 4 bytes per element
        # beside the output at the unpack, where a dequantize holds its output alone (a GELU's
        # backward then peaked at 2.25x its input's size instead of 1x); a piece's copy holds
        # 0.5 bytes per element
        out = torch.empty(flat.shape, dtype=dtype, device=codes.device)
        piece = -(-numel // LOOKUP_PIECES)
        for start in range(0, numel, piece):
            chunk = flat[start : start + piece]
            torch.index_select(inputs, 0, chunk.int(), out=out[start : start + chunk.numel()])
        return out.view(codes.shape)


@functools.lru_cache(maxsize=256)
def _moved(
    function: str, bits: int, field: str, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """A field of ``derivative_table(function, bits)`` on ``device`` in ``dtype``, copied once
    rather than at every save."""
    return getattr(derivative_table(function, bits), field).to(device=device, dtype=dtype)


@functools.cache
def derivative_table(function: str, bits: int) -> DerivativeTable:
    """The ``bits``-bit table of ``function``, fitted once per process (see NOTE above).

    Raises:
        ValueError: an unknown function or ``bits`` outside ``[1, MAX_TABLE_BITS]``.
    """
    if function not in DERIVATIVES:
        raise ValueError(f"no derivative table for {function!r}; known: {sorted(DERIVATIVES)}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_TABLE_BITS:
        raise ValueError(f"bits must be an int in [1, {MAX_TABLE_BITS}], got {bits!r}")
    prime = DERIVATIVES[function][0]
    points, per_bin = 8192, 16
    probs = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    x = torch.special.ndtri(probs)  # N(0, 1) quantiles, increasing
    d = prime(x)
    bin_means = d.view(-1, per_bin).mean(1)
    fit = gact_policy.fit_piecewise_constant(bin_means.numpy(), 2**bits)
    starts = [int(s) * per_bin for s in fit.starts]
    ends = [*starts[1:], points]
    bounds = torch.tensor([0.5 * (x[s - 1] + x[s]) for s in starts[1:]], dtype=torch.float64)
    levels = torch.tensor(fit.levels, dtype=torch.float64)
    inputs = []
    for s, e, level in zip(starts, ends, levels):
        fine = torch.linspace(float(x[s]), float(x[e - 1]), 1 << 16, dtype=torch.float64)
        gap = (prime(fine) - level).abs()
        inputs.append(_refine(prime, fine[int(gap.argmin())], float(level), fine))
    return DerivativeTable(
        function, bits, bounds, levels, torch.tensor(inputs, dtype=torch.float64)
    )


def _refine(
    prime: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    level: float,
    grid: torch.Tensor,
) -> float:
    """Bisection between the grid neighbours of ``x0`` that bracket ``f'(x) = level``."""
    step = float(grid[1] - grid[0]) if grid.numel() > 1 else 0.0
    lo, hi = float(x0) - step, float(x0) + step
    f_lo = float(prime(torch.tensor(lo, dtype=torch.float64))) - level
    f_hi = float(prime(torch.tensor(hi, dtype=torch.float64))) - level
    if f_lo * f_hi > 0:  # the grid point itself is the closest (a flat or single-point piece)
        return float(x0)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        f_mid = float(prime(torch.tensor(mid, dtype=torch.float64))) - level
        if f_lo * f_mid <= 0:
            hi = mid
        else:
            lo, f_lo = mid, f_mid
    return 0.5 * (lo + hi)


def table_is_better(
    x: torch.Tensor, table: DerivativeTable, *, group_size: int, max_groups: int = 64
) -> bool:
    """Whether ``table`` approximates ``f'`` on ``x`` better than ``table.bits``-bit stochastic
    rounding would, judged on up to ``max_groups`` whole groups spread over ``x`` (expected
    squared derivative error of rounding, against the table's squared error)."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    groups = -(-n // group_size)
    picked = torch.linspace(0, groups - 1, min(groups, max_groups), device=x.device).long()
    idx = (picked.unsqueeze(1) * group_size + torch.arange(group_size, device=x.device)).clamp(
        max=n - 1
    )
    v = flat[idx].double()
    prime = DERIVATIVES[table.function][0]
    d = prime(v)
    lo, hi = v.amin(1, keepdim=True), v.amax(1, keepdim=True)
    step = (hi - lo) / (2**table.bits - 1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    t = ((v - lo) / safe).clamp(0, 2**table.bits - 1)
    below = torch.floor(t).clamp(max=2**table.bits - 2)
    p = t - below
    x_lo = lo + below * safe
    rounding = p * (prime(x_lo + safe) - d) ** 2 + (1 - p) * (prime(x_lo) - d) ** 2
    rounding = torch.where(step > 0, rounding, torch.zeros_like(rounding))
    levels = table.levels.to(x.device)
    approx = levels[torch.bucketize(v, table.bounds.to(x.device))]
    return bool(((approx - d) ** 2).sum() < rounding.sum())
