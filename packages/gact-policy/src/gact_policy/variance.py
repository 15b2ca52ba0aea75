"""The variance model shared by the allocator, the estimators and the runtime.

``S(b) = 1/(2^b - 1)^2`` is the variance factor of unbiased stochastic rounding to ``b`` bits,
and ``Σ_l c_l S(b_l)`` the predicted extra gradient variance of an allocation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ._checks import integer_values, real_array

__all__ = ["FULL_PRECISION", "predicted_variance", "variance_factor"]

FULL_PRECISION: int = 16
"""Widths at or above this value mean "not quantised" (variance factor 0)."""

# NOTE [Variance model]
# An item (a saved activation, a weight matrix, ...) is split into groups; each group with range
# ``R = max - min`` is quantised to ``b`` bits on the grid ``min + q·Δ`` with ``Δ = R / (2^b - 1)``
# and *unbiased* stochastic rounding: ``x`` in ``[min + qΔ, min + (q+1)Δ)`` is rounded up with
# probability ``t = (x - min)/Δ - q``. The error is zero-mean with variance ``Δ²·t(1 - t) <= Δ²/4``.
# To first order the gradient computed from the compressed item is
# ``g(Q(h)) ≈ g(h) + J (Q(h) - h)``: unbiased, with extra variance
# ``E‖J (Q(h) - h)‖² <= Σ_groups ‖J_group‖² R_group² / 4 · 1/(2^b - 1)²``. Everything that does not
# depend on ``b`` (Jacobian norms, ranges, the constant 1/4) is absorbed into the item's
# *sensitivity* ``c_l``, which leaves the bit-dependent factor
#
#     S(b) = 1 / (2^b - 1)²          (S(1) = 1, S(2) = 1/9, S(4) = 1/225, S(8) = 1/65025)
#
# and the predicted extra gradient variance ``Σ_l c_l · S(b_l)``. An item kept at its original
# precision adds no noise: ``S = 0``. Widths ``b >= FULL_PRECISION`` (16) denote "full
# precision"; callers report such items with their original width (16 for bf16, 32 for fp32).
#
# The estimators in ``sensitivity.py`` use the same ``S``: re-seeding item ``l`` alone changes
# the gradient by ``J_l (ε - ε')`` with two independent draws, so ``E‖g0 - g_l‖² = 2 c_l S(b_l)``.


def _as_bits(bits: Any) -> np.ndarray:
    arr = integer_values(bits, "bits")
    if arr.size and arr.min() < 1:
        raise ValueError(f"bits must be >= 1, got minimum {int(arr.min())}")
    return arr


def variance_factor(bits: ArrayLike) -> np.ndarray | float:
    """Variance factor ``S(b)`` of unbiased stochastic rounding to ``b`` bits.

    ``S(b) = 1/(2^b - 1)²`` for quantised widths ``1 <= b < FULL_PRECISION`` and ``0`` for
    ``b >= FULL_PRECISION`` (kept at full precision); see NOTE [Variance model].

    Args:
        bits: integer width or array of widths (>= 1).

    Returns:
        A float for scalar input, else a float64 array of the same shape.

    Raises:
        TypeError: if ``bits`` is not numeric (or is boolean).
        ValueError: if a width is not a whole number or is < 1.

    Example:
        >>> float(variance_factor(2))
        0.1111111111111111
        >>> variance_factor([1, 4, 32]).tolist()
        [1.0, 0.0044444444444444444, 0.0]
    """
    arr = _as_bits(bits)
    quantised = arr < FULL_PRECISION
    levels = np.exp2(np.where(quantised, arr, 1).astype(np.float64)) - 1.0
    out = np.where(quantised, 1.0 / (levels * levels), 0.0)
    return float(out) if out.ndim == 0 else out


def predicted_variance(sensitivity: ArrayLike, bits: ArrayLike) -> float:
    """Predicted extra gradient variance ``Σ_l c_l · S(b_l)``.

    Args:
        sensitivity: per-item sensitivities ``c_l >= 0`` (1-D).
        bits: per-item widths (1-D, same length), or one width for all items.

    Returns:
        The predicted variance as a float (``inf``/``nan`` sensitivities propagate, except at
        full precision, which adds nothing).

    Raises:
        TypeError: on non-numeric arguments.
        ValueError: on a negative sensitivity, an invalid width or a length mismatch.

    Example:
        >>> predicted_variance([1.0, 9.0], [1, 2])
        2.0
    """
    c = real_array(sensitivity, "sensitivity")
    if np.any(c < 0):
        raise ValueError("sensitivity must be non-negative")
    b = _as_bits(bits)
    if b.ndim > 1 or (b.ndim == 1 and b.shape != c.shape):
        raise ValueError(f"bits must be one width or one per item ({c.size}), got shape {b.shape}")
    s = variance_factor(b)
    with np.errstate(invalid="ignore"):  # inf·0 at full precision: that term is 0
        terms = np.where(np.asarray(s) == 0.0, 0.0, c * s)
    return float(np.sum(terms))
