"""Argument checks shared by the public functions (private).

Wrong types raise ``TypeError`` and wrong values ``ValueError``, always naming the argument.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = [
    "integer_array",
    "integer_scalar",
    "integer_values",
    "per_item",
    "real_array",
    "real_scalar",
]

_INT64_MAX = int(np.iinfo(np.int64).max)


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def real_scalar(value: Any, name: str) -> float:
    """``value`` as a float; a real number (not a bool, string or array) is required."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def integer_scalar(value: Any, name: str) -> int:
    """``value`` as an int; an integer or an integral float (not a bool) is required."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        return int(value)
    f = float(value)
    if not (np.isfinite(f) and f == np.floor(f)):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(f)


def _numeric(value: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{name} must be an array of numbers: {exc}") from None
    if arr.dtype.kind == "b" or (
        isinstance(value, (list, tuple)) and arr.ndim == 1 and any(map(_is_bool, value))
    ):  # numpy turns [True, 4] into integers
        raise TypeError(f"{name} must hold numbers, not booleans")
    if arr.dtype.kind not in "iuf":
        raise TypeError(
            f"{name} must hold real numbers, got dtype {arr.dtype} (strings, None, complex "
            "values or integers beyond int64 are not accepted)"
        )
    return arr


def _one_dim(arr: np.ndarray, name: str) -> np.ndarray:
    if arr.ndim != 1:
        raise ValueError(
            f"{name} must be one-dimensional (one entry per item), got shape {arr.shape}"
        )
    return arr


def real_array(value: Any, name: str) -> np.ndarray:
    """``value`` as a 1-D float64 array (NaN and infinities pass; callers check ranges)."""
    return _one_dim(_numeric(value, name), name).astype(np.float64)


def _as_int64(arr: np.ndarray, name: str) -> np.ndarray:
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.floor(arr))
        if bad.any():
            raise ValueError(f"{name} must hold whole numbers, got {arr[bad].flat[0]!r}")
    if arr.size and (arr.max() > _INT64_MAX or arr.min() < -_INT64_MAX):
        raise ValueError(f"{name} holds a value beyond int64: {arr.max()!r}")
    return arr.astype(np.int64)


def integer_values(value: Any, name: str) -> np.ndarray:
    """``value`` (any shape) as an int64 array; integers or integral floats are required."""
    return _as_int64(_numeric(value, name), name)


def integer_array(value: Any, name: str) -> np.ndarray:
    """``value`` as a 1-D int64 array; integers or integral floats are required."""
    return _as_int64(_one_dim(_numeric(value, name), name), name)


def per_item(value: Any, n: int, name: str, integer: bool) -> np.ndarray:
    """A scalar or one entry per item, broadcast to a read-only length-``n`` array."""
    arr = _numeric(value, name)
    if arr.ndim > 1 or (arr.ndim == 1 and arr.size != n):
        raise ValueError(
            f"{name} must be a scalar or have one entry per item ({n}), got shape {arr.shape}"
        )
    arr = _as_int64(arr, name) if integer else arr.astype(np.float64)
    return np.broadcast_to(arr, (n,))
