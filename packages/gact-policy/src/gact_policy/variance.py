"""The one variance model shared by the allocator, the estimators and the runtime.

Derivation
----------
An item (a saved activation, a weight matrix, ...) is split into groups; each group with range
``R = max - min`` is quantised to ``b`` bits on the grid ``min + q·Δ`` with ``Δ = R / (2^b - 1)``
and *unbiased* stochastic rounding: ``x`` in ``[min + qΔ, min + (q+1)Δ)`` is rounded up with
probability ``t = (x - min)/Δ - q``. The error is zero-mean with variance ``Δ²·t(1 - t) ≤ Δ²/4``.
To first order the gradient computed from the compressed item is
``g(Q(h)) ≈ g(h) + J (Q(h) - h)``: unbiased, with extra variance
``E‖J (Q(h) - h)‖² ≤ Σ_groups ‖J_group‖² R_group² / 4 · 1/(2^b - 1)²``. Everything that does not
depend on ``b`` (Jacobian norms, ranges, the constant 1/4) is absorbed into the item's
*sensitivity* ``c_l``, which leaves the bit-dependent factor

    S(b) = 1 / (2^b - 1)²          (S(1) = 1, S(2) = 1/9, S(4) = 1/225, S(8) = 1/65025)

and the predicted extra gradient variance ``Σ_l c_l · S(b_l)``. An item kept at its original
precision adds no noise: ``S = 0``. Widths ``b ≥ FULL_PRECISION`` (16) denote "full precision";
callers report such items with their original width (16 for bf16/fp16, 32 for fp32).

The estimators in :mod:`gact_policy.sensitivity` use the same ``S``: re-seeding item ``l`` alone
changes the gradient by ``J_l (ε - ε')`` with two independent draws, so
``E‖g0 - g_l‖² = 2 c_l S(b_l)``.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["FULL_PRECISION", "MAX_QUANT_BITS", "predicted_variance", "variance_factor"]

FULL_PRECISION: int = 16
"""Widths at or above this value mean "not quantised" (variance factor 0)."""

MAX_QUANT_BITS: int = FULL_PRECISION - 1
"""Widest quantised width the model accepts (15 bits)."""


def _as_bits(bits: ArrayLike) -> np.ndarray:
    arr = np.asarray(bits)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"bit widths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 1:
        raise ValueError(f"bit widths must be >= 1, got minimum {int(arr.min())}")
    return arr


def variance_factor(bits: ArrayLike) -> np.ndarray | float:
    """Variance factor ``S(b)`` of unbiased stochastic rounding to ``b`` bits.

    ``S(b) = 1/(2^b - 1)²`` for quantised widths ``1 <= b < FULL_PRECISION`` and ``0`` for
    ``b >= FULL_PRECISION`` (kept at full precision). See the module docstring for the
    derivation.

    Args:
        bits: integer width or array of widths (>= 1).

    Returns:
        A float for scalar input, else a float64 array of the same shape.

    Raises:
        ValueError: if a width is not an integer or is < 1.

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
        sensitivity: per-item sensitivities ``c_l >= 0``.
        bits: per-item widths (broadcast against ``sensitivity``).

    Returns:
        The predicted variance as a float (``inf``/``nan`` propagate from the sensitivities).

    Raises:
        ValueError: on a negative sensitivity or an invalid width.

    Example:
        >>> predicted_variance([1.0, 9.0], [1, 2])
        2.0
    """
    c = np.asarray(sensitivity, dtype=np.float64)
    if np.any(c < 0):
        raise ValueError("sensitivities must be non-negative")
    s = variance_factor(bits)
    terms = np.where(np.asarray(s) == 0.0, 0.0, c * s)
    return float(np.sum(terms))
