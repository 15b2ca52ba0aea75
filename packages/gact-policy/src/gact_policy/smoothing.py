"""Exponential smoothing of sensitivity estimates across adaptations, robust to NaN/Inf."""

from __future__ import annotations

from typing import Optional

import numpy as np
from numpy.typing import ArrayLike

from .sensitivity import SENSITIVITY_CAP

__all__ = ["SensitivityTracker", "smooth"]


def _check_momentum(momentum: float) -> float:
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    return float(momentum)


def smooth(prev: Optional[ArrayLike], new: ArrayLike, momentum: float) -> np.ndarray:
    """``momentum·prev + (1 - momentum)·new``, keeping ``prev`` where ``new`` is not finite.

    Without a previous state (``prev`` None) the new estimate is returned, with non-finite
    entries replaced by ``SENSITIVITY_CAP`` (most sensitive). Negative estimates are rejected.

    Args:
        prev: previous smoothed sensitivities, or None.
        new: new estimate, same length.
        momentum: weight of the past, in ``[0, 1)``.

    Returns:
        The smoothed sensitivities (float64, finite).

    Raises:
        ValueError: on a length mismatch, a negative value or a bad momentum.

    Example:
        >>> smooth([1.0, 2.0], [3.0, float("nan")], 0.5).tolist()
        [2.0, 2.0]
    """
    mom = _check_momentum(momentum)
    x = np.asarray(new, dtype=np.float64).reshape(-1)
    if np.any(x < 0):
        raise ValueError("sensitivities must be non-negative")
    good = np.isfinite(x)
    if prev is None:
        return np.where(good, np.minimum(x, SENSITIVITY_CAP), SENSITIVITY_CAP)
    p = np.asarray(prev, dtype=np.float64).reshape(-1)
    if p.shape != x.shape:
        raise ValueError(f"length mismatch: previous {p.size} items, new {x.size}")
    return np.where(
        good, mom * p + (1.0 - mom) * np.minimum(np.where(good, x, 0.0), SENSITIVITY_CAP), p
    )


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
        """Fold a new estimate into the state and return the smoothed sensitivities."""
        self._value = smooth(self._value, estimate, self.momentum)
        return self._value.copy()

    def reset(self) -> None:
        """Forget the state (e.g. when the set of items changes)."""
        self._value = None
