"""Exponential smoothing of sensitivity estimates across adaptations, robust to NaN/Inf."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from numpy.typing import ArrayLike

from ._checks import real_array, real_scalar
from .sensitivity import SENSITIVITY_CAP

__all__ = ["SensitivityTracker", "smooth"]


def _check_momentum(momentum: Any) -> float:
    mom = real_scalar(momentum, "momentum")
    if not 0.0 <= mom < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    return mom


def _estimates(value: Any, name: str) -> np.ndarray:
    x = real_array(value, name)
    if np.any(x < 0):
        raise ValueError(f"{name} must hold non-negative sensitivities, got {x[x < 0][0]!r}")
    return x


def smooth(prev: Optional[ArrayLike], new: ArrayLike, momentum: float) -> np.ndarray:
    """``momentum·prev + (1 - momentum)·new``, finite whatever the inputs.

    Where ``new`` is not finite the previous value is kept; where ``prev`` is not finite (or
    ``prev`` is None) the new value is taken; where neither is finite the result is
    ``SENSITIVITY_CAP`` (most sensitive). All values are capped at ``SENSITIVITY_CAP``.

    Args:
        prev: previous smoothed sensitivities (1-D), or None.
        new: new estimate (1-D, same length).
        momentum: weight of the past, in ``[0, 1)``.

    Returns:
        The smoothed sensitivities (float64, finite, in ``[0, SENSITIVITY_CAP]``).

    Raises:
        TypeError: on non-numeric arguments.
        ValueError: on a length mismatch, a negative value or a momentum outside ``[0, 1)``.

    Example:
        >>> smooth([1.0, 2.0], [3.0, float("nan")], 0.5).tolist()
        [2.0, 2.0]
        >>> smooth([1.0, float("nan")], [float("nan"), 2.0], 0.5).tolist()
        [1.0, 2.0]
    """
    mom = _check_momentum(momentum)
    x = _estimates(new, "new")
    p = np.full(x.shape, np.nan) if prev is None else _estimates(prev, "prev")
    if p.shape != x.shape:
        raise ValueError(f"length mismatch: prev has {p.size} items, new {x.size}")
    has_x, has_p = np.isfinite(x), np.isfinite(p)
    x = np.minimum(np.where(has_x, x, 0.0), SENSITIVITY_CAP)
    p = np.minimum(np.where(has_p, p, 0.0), SENSITIVITY_CAP)
    both = mom * p + (1.0 - mom) * x
    return np.where(has_x & has_p, both, np.where(has_x, x, np.where(has_p, p, SENSITIVITY_CAP)))


class SensitivityTracker:
    """Holds the smoothed sensitivities between adaptations.

    Args:
        momentum: weight of the past in :func:`smooth` (``0`` keeps only the latest).

    Example:
        >>> t = SensitivityTracker(momentum=0.5)
        >>> t.update([4.0, 8.0]).tolist()
        [4.0, 8.0]
        >>> t.update([0.0, float("inf")]).tolist()
        [2.0, 8.0]
    """

    def __init__(self, momentum: float = 0.9) -> None:
        self.momentum = _check_momentum(momentum)
        self._value: Optional[np.ndarray] = None

    @property
    def value(self) -> Optional[np.ndarray]:
        """Current smoothed sensitivities (a copy), or None before the first update."""
        return None if self._value is None else self._value.copy()

    def update(self, estimate: ArrayLike) -> np.ndarray:
        """Fold a new estimate into the state and return the smoothed sensitivities.

        Bad input raises (see :func:`smooth`) and leaves the state unchanged.
        """
        self._value = smooth(self._value, estimate, self.momentum)
        return self._value.copy()

    def reset(self) -> None:
        """Forget the state (e.g. when the set of items changes)."""
        self._value = None
