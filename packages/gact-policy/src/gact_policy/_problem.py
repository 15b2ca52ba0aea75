"""Validation and the cost and variance matrices of an allocation problem (private)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

import numpy as np

from ._checks import integer_array, integer_scalar, per_item, real_array, real_scalar
from .variance import FULL_PRECISION, variance_factor

__all__ = ["Costs", "budget_bits", "costs", "item_costs", "scaled_sensitivity"]

_DEFAULT_CHOICES = (1, 2, 3, 4, 5, 6, 7, 8, FULL_PRECISION)

# NOTE [Integer costs]
# Costs are exact int64 bits: a quantised item costs ``numel·b + ceil(numel·overhead_bits)``, a
# full-precision one ``numel·full_bits``. Every sum the solvers form (the costs of all items at
# their widest allowed width, plus a budget clamped to that total) stays below ``_MAX_TOTAL``, so
# no int64 arithmetic can overflow; inputs that could exceed it (about 576 PB of storage) are
# refused instead of being computed wrongly.
_MAX_TOTAL = 2**62


def _metadata_bits(
    size: np.ndarray, widest: Any, full_bits: np.ndarray, overhead_bits: Any
) -> np.ndarray:
    """``ceil(numel·overhead_bits)`` per item, after checking that no cost sum can overflow
    (``widest``: the largest width an item may be charged, scalar or per item)."""
    ov = per_item(overhead_bits, size.size, "overhead_bits", integer=False)
    if not np.all(np.isfinite(ov)) or np.any(ov < 0):
        raise ValueError("overhead_bits must be finite and >= 0 (bits per element)")
    if float(np.sum(size * np.maximum(widest + ov + 1.0, full_bits))) >= _MAX_TOTAL:
        raise ValueError(
            "numel, full_bits or overhead_bits too large: the storage could exceed 2**62 bits, "
            "beyond exact int64 arithmetic"
        )
    return np.ceil(np.round(size * ov, 6)).astype(np.int64)


def item_costs(
    size: np.ndarray, widths: np.ndarray, full_bits: np.ndarray, overhead_bits: Any
) -> np.ndarray:
    """Cost in bits of giving item ``l`` the width ``widths[l]`` (NOTE [Integer costs]); widths
    ``>= FULL_PRECISION`` mean full precision."""
    meta = _metadata_bits(size, widths, full_bits, overhead_bits)
    return np.where(widths < FULL_PRECISION, size * widths + meta, size * full_bits)


def _cost_matrix(
    size: np.ndarray, widths: np.ndarray, full_bits: np.ndarray, overhead_bits: Any
) -> np.ndarray:
    """:func:`item_costs` of every quantised width in ``widths`` and of full precision (the
    last column), as an ``(items, choices)`` matrix in Fortran order."""
    meta = _metadata_bits(size, widths.max(initial=1), full_bits, overhead_bits)
    w = np.empty((size.size, widths.size + 1), dtype=np.int64, order="F")
    w_t = w.T  # choice-major view: contiguous rows
    np.multiply.outer(widths, size, out=w_t[:-1])
    w_t[:-1] += meta
    np.multiply(size, full_bits, out=w_t[-1])
    return w


def scaled_sensitivity(sensitivity: Any) -> np.ndarray:
    """Sensitivities divided by the largest finite one; NaN/+inf become 2 (1 if none > 0)."""
    c = real_array(sensitivity, "sensitivity")
    if np.any(c < 0):  # NaN compares False
        raise ValueError(f"sensitivity must be non-negative, got {c[c < 0][0]!r}")
    finite = np.isfinite(c)
    top = float(c[finite].max()) if finite.any() else 0.0
    if top == 0.0:
        return np.where(finite, 0.0, 1.0)
    return np.where(finite, np.where(finite, c, 0.0) / top, 2.0)


def budget_bits(avg_bits: Any, budget_bytes: Any, total_numel: int) -> int:
    """``floor(avg_bits·Σ numel)`` (with a 1e-6 bit tolerance) or ``8·budget_bytes``."""
    if (avg_bits is None) == (budget_bytes is None):
        raise ValueError("give exactly one of avg_bits and budget_bytes (the other None)")
    if budget_bytes is not None:
        n_bytes = integer_scalar(budget_bytes, "budget_bytes")
        if n_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {n_bytes}")
        return 8 * n_bytes
    avg = real_scalar(avg_bits, "avg_bits")
    if not (math.isfinite(avg) and avg >= 0.0):
        raise ValueError(f"avg_bits must be finite and >= 0, got {avg}")
    return math.floor(Fraction(avg) * total_numel + Fraction(1, 10**6))


@dataclass(frozen=True)
class Costs:
    """Allowed choices and their costs, one row per item, choice-major (Fortran order).

    Columns are the quantised ``widths`` shared by all items, then full precision (reported as
    the item's ``full_bits``).
    """

    size: np.ndarray
    full_bits: np.ndarray
    widths: np.ndarray
    ok: np.ndarray
    w: np.ndarray
    least: int  # cost of the cheapest allowed allocation
    most: int  # cost of the dearest allowed allocation: larger budgets buy nothing more

    def bits(self, column: np.ndarray) -> np.ndarray:
        """Reported width of a column choice per item."""
        return np.where(
            column < self.widths.size, np.append(self.widths, 0)[column], self.full_bits
        )

    def values(self, scaled: np.ndarray) -> np.ndarray:
        """Predicted variance ``c_l·S(b)`` of every choice (0 at full precision)."""
        v = np.zeros(self.ok.shape, order="F")
        np.multiply.outer(variance_factor(self.widths), scaled, out=v.T[:-1])
        return v


def _choice_widths(choices: Any) -> np.ndarray:
    allowed = integer_array(_DEFAULT_CHOICES if choices is None else choices, "choices")
    if allowed.size == 0 or allowed.min() < 1:
        raise ValueError("choices must be a non-empty sequence of widths >= 1")
    return allowed


def costs(
    numel: Any,
    n: Optional[int],
    *,
    choices: Any,
    full_bits: Any,
    overhead_bits: Any,
    lower: Any,
    upper: Any,
    pinned: Any,
) -> Costs:
    """Validate the per-item arguments and build the allowed-choice and cost matrices.

    ``n`` is the number of items (``numel`` may then be a scalar), or None to take it from
    ``numel``.
    """
    size = integer_array(numel, "numel") if n is None else per_item(numel, n, "numel", True)
    n = size.size
    if np.any(size < 0):
        raise ValueError(f"numel must be >= 0, got {int(size.min())}")
    fb = per_item(full_bits, n, "full_bits", integer=True)
    if np.any(fb < FULL_PRECISION):
        raise ValueError(f"full_bits must be >= FULL_PRECISION ({FULL_PRECISION})")
    allowed = _choice_widths(choices)
    pin = np.zeros(n, np.int64) if pinned is None else per_item(pinned, n, "pinned", True)
    if np.any(pin < 0):
        raise ValueError("pinned widths must be >= 0 (0 = not pinned)")
    widths = np.unique(np.concatenate([allowed, pin[pin > 0]]))
    widths = widths[widths < FULL_PRECISION]
    ok = np.empty((n, widths.size + 1), dtype=bool, order="F")
    ok_t = ok.T
    ok_t[:-1] = np.isin(widths, allowed)[:, None]
    ok_t[-1] = allowed.max() >= FULL_PRECISION
    for bound, name in ((lower, "lower"), (upper, "upper")):
        if bound is not None:
            lim = per_item(bound, n, name, integer=True)
            above = name == "lower"
            ok_t[:-1] &= (widths[:, None] >= lim) if above else (widths[:, None] <= lim)
            ok_t[-1] &= (fb >= lim) if above else (fb <= lim)
    is_pinned = pin > 0
    if is_pinned.any():
        pin_full = (pin >= FULL_PRECISION) | (pin == fb)
        ok[is_pinned, :-1] = ~pin_full[is_pinned, None] & (widths == pin[is_pinned, None])
        ok[is_pinned, -1] = pin_full[is_pinned]
    empty = np.zeros(0, np.int64) if ok.all() else np.flatnonzero(~ok.any(axis=1))
    if empty.size:
        raise ValueError(
            f"item {int(empty[0])} has no allowed width: widen choices or lower/upper, or fix "
            "its pin"
        )
    w = _cost_matrix(size, widths, fb, overhead_bits)
    if ok.all():
        least, most = w.T.min(axis=0).sum(), w.T.max(axis=0).sum()
    else:
        least = np.where(ok, w, _MAX_TOTAL).T.min(axis=0).sum()
        most = np.where(ok, w, 0).T.max(axis=0).sum()
    return Costs(size, fb, widths, ok, w, int(least), int(most))
