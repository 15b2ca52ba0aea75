"""Variance-minimising bit allocation under a memory budget.

Each item ``l`` (a saved activation, a weight matrix, ...) has ``numel[l]`` elements and a
sensitivity ``c[l]``. Choosing width ``b_l`` costs ``numel·b_l + ceil(numel·overhead_bits)`` bits
when quantised (the per-group metadata, e.g. ``64/group_size`` bits per element for a float32
``(lo, scale)`` pair per group) and ``numel·full_bits`` bits when kept at full precision, and adds
``c_l·S(b_l)`` to the predicted gradient variance (:func:`gact_policy.variance_factor`).
:func:`allocate_bits` minimises ``Σ c_l S(b_l)`` subject to ``Σ cost_l <= budget``; see
:mod:`gact_policy._mckp` for the algorithms and their optimality proofs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import numpy as np
from numpy.typing import ArrayLike

from ._mckp import solve_exact, solve_greedy
from .variance import FULL_PRECISION, variance_factor

__all__ = ["DEFAULT_CHOICES", "allocate_bits", "storage_bits"]

DEFAULT_CHOICES: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, FULL_PRECISION)
"""Allowed widths when ``choices`` is None: 1..8 bits or full precision."""

_IntLike = Union[int, ArrayLike]


def _per_item(value: ArrayLike, n: int, name: str, dtype: type) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim > 1 or (arr.ndim == 1 and arr.size != n):
        raise ValueError(f"{name} must be a scalar or have one entry per item ({n})")
    if dtype is np.int64 and arr.size and arr.dtype.kind not in "iub":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise ValueError(f"{name} must hold integers")
    return np.broadcast_to(arr.astype(dtype), (n,))


def _overhead(numel: np.ndarray, overhead_bits: ArrayLike) -> np.ndarray:
    ov = _per_item(overhead_bits, numel.size, "overhead_bits", np.float64)
    if not np.all(np.isfinite(ov)) or np.any(ov < 0):
        raise ValueError("overhead_bits must be finite and >= 0")
    return np.ceil(np.round(numel * ov, 6)).astype(np.int64)


def storage_bits(
    numel: ArrayLike, bits: ArrayLike, *, full_bits: _IntLike = 32, overhead_bits: ArrayLike = 0.0
) -> int:
    """Exact storage cost in bits that :func:`allocate_bits` charges for an allocation.

    Args:
        numel: element count per item.
        bits: width per item; ``>= FULL_PRECISION`` means kept at full precision.
        full_bits: original width per item (scalar or per item), charged for full precision.
        overhead_bits: metadata bits per element charged to quantised items only; rounded up to
            whole bits per item.

    Returns:
        Total cost in bits.

    Example:
        >>> storage_bits([256, 256], [4, 32], overhead_bits=0.25)
        9280
    """
    n = np.asarray(numel, dtype=np.int64).reshape(-1)
    b = np.broadcast_to(np.asarray(bits, dtype=np.int64), n.shape)
    fb = _per_item(full_bits, n.size, "full_bits", np.int64)
    quant = b < FULL_PRECISION
    return int(np.sum(np.where(quant, n * b + _overhead(n, overhead_bits), n * fb)))


def _sensitivity(sensitivity: ArrayLike) -> np.ndarray:
    c = np.asarray(sensitivity, dtype=np.float64).reshape(-1)
    if np.any(c < 0):
        raise ValueError("sensitivities must be non-negative (got a negative value)")
    finite = np.isfinite(c)
    top = float(c[finite].max()) if finite.any() else 0.0
    c = np.where(finite, c, 2.0 * top if top > 0 else 1.0)  # NaN/+inf: most sensitive
    peak = float(c.max()) if c.size else 0.0
    return c / peak if peak > 0 else c


def _budget(avg_bits: Optional[float], budget_bytes: Optional[int], total: int) -> int:
    if (avg_bits is None) == (budget_bytes is None):
        raise ValueError("give exactly one of avg_bits and budget_bytes")
    if budget_bytes is not None:
        if int(budget_bytes) != budget_bytes or budget_bytes < 0:
            raise ValueError("budget_bytes must be a non-negative integer")
        return 8 * int(budget_bytes)
    if not np.isfinite(avg_bits) or avg_bits < 0:
        raise ValueError("avg_bits must be finite and >= 0")
    return int(np.floor(float(avg_bits) * total + 1e-6))


def allocate_bits(
    sensitivity: ArrayLike,
    numel: ArrayLike,
    avg_bits: Optional[float],
    *,
    choices: Optional[Sequence[int]] = None,
    method: str = "exact",
    budget_bytes: Optional[int] = None,
    full_bits: _IntLike = 32,
    overhead_bits: ArrayLike = 0.0,
    lower: Optional[_IntLike] = None,
    upper: Optional[_IntLike] = None,
    pinned: Optional[ArrayLike] = None,
) -> np.ndarray:
    """Choose a width per item minimising ``Σ c_l S(b_l)`` within a memory budget.

    Semantics: full precision is requested with any width ``>= FULL_PRECISION`` in ``choices``
    and reported as the item's ``full_bits``. A quantised item costs
    ``numel·b + ceil(numel·overhead_bits)`` bits, a full-precision one ``numel·full_bits``. The
    budget is ``floor(avg_bits·Σ numel)`` bits or ``8·budget_bytes``; the result never exceeds
    it. Sensitivities are scale-free; NaN/+inf count as twice the largest finite value (most
    sensitive). Among equally good allocations, interchangeable items (same size, bounds and
    costs) get widths in order of decreasing sensitivity, ties to the lower index, so the result
    is deterministic and monotone. Equal items get uniform widths; when the uniform width is not
    affordable for all, greedy raises the lowest-indexed items one hull step.

    Args:
        sensitivity: ``c_l >= 0`` per item (NaN/+inf allowed, see above).
        numel: element count per item (``>= 0``; zero-size items cost nothing).
        avg_bits: budget in bits per element over all items (including overhead), or None when
            ``budget_bytes`` is given.
        choices: allowed widths (default 1..8 and full precision).
        method: ``"exact"`` (provably optimal) or ``"greedy"`` (hull greedy: optimal when the
            budget lands on a breakpoint, otherwise within ``λ·slack``).
        budget_bytes: alternative absolute budget in bytes.
        full_bits: original width per item (scalar or per item, ``>= FULL_PRECISION``).
        overhead_bits: metadata bits per element for quantised items (e.g. ``64/256``).
        lower: smallest allowed reported width per item (scalar or per item).
        upper: largest allowed reported width per item (``upper=8`` forbids full precision).
        pinned: per-item width, 0 for free items; a pin overrides choices and bounds.

    Returns:
        int64 array of widths (full precision as ``full_bits``).

    Raises:
        ValueError: on invalid input, an item with no allowed width, or an infeasible budget
            (the message states the minimum achievable average).

    Example:
        >>> allocate_bits([1.0, 100.0], [1000, 1000], 4.0).tolist()
        [3, 5]
    """
    c = _sensitivity(sensitivity)
    n = c.size
    size = _per_item(numel, n, "numel", np.int64).astype(np.int64)
    if np.any(size < 0):
        raise ValueError("numel must be >= 0")
    if method not in ("exact", "greedy"):
        raise ValueError(f"method must be 'exact' or 'greedy', got {method!r}")
    fb = _per_item(full_bits, n, "full_bits", np.int64)
    if np.any(fb < FULL_PRECISION):
        raise ValueError(f"full_bits must be >= FULL_PRECISION ({FULL_PRECISION})")
    allowed = np.asarray(DEFAULT_CHOICES if choices is None else choices, dtype=np.int64)
    if allowed.size == 0 or allowed.min() < 1:
        raise ValueError("choices must be a non-empty set of widths >= 1")
    pin = np.zeros(n, np.int64) if pinned is None else _per_item(pinned, n, "pinned", np.int64)
    if np.any(pin < 0):
        raise ValueError("pinned widths must be >= 0 (0 = not pinned)")
    quant = np.unique(np.concatenate([allowed, pin[pin > 0]]))
    quant = quant[quant < FULL_PRECISION]
    # Columns: the quantised widths ``quant`` (shared by all items), then full precision. The
    # (items, choices) matrices are stored choice-major (Fortran order): numpy's elementwise
    # ops and reductions over the few choices of every item are several times faster so.
    ok = np.empty((n, quant.size + 1), dtype=bool, order="F")
    ok_t = ok.T
    ok_t[:-1] = np.isin(quant, allowed)[:, None]
    ok_t[-1] = allowed.max() >= FULL_PRECISION
    for bound, name, above in ((lower, "lower", True), (upper, "upper", False)):
        if bound is not None:
            lim = _per_item(bound, n, name, np.int64)
            if above:
                ok_t[:-1] &= quant[:, None] >= lim
                ok_t[-1] &= fb >= lim
            else:
                ok_t[:-1] &= quant[:, None] <= lim
                ok_t[-1] &= fb <= lim
    is_pinned = pin > 0
    if is_pinned.any():
        pin_full = (pin >= FULL_PRECISION) | (pin == fb)
        ok[is_pinned, :-1] = ~pin_full[is_pinned, None] & (quant == pin[is_pinned, None])
        ok[is_pinned, -1] = pin_full[is_pinned]
    empty = np.zeros(0, np.int64) if ok.all() else np.flatnonzero(~ok.any(axis=1))
    if empty.size:
        raise ValueError(f"item {int(empty[0])} has no allowed width (check choices/bounds)")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    total = int(size.sum())
    budget = _budget(avg_bits, budget_bytes, total)
    ov = _overhead(size, overhead_bits)
    w = np.empty(ok.shape, dtype=np.int64, order="F")
    w_t = w.T
    np.multiply.outer(quant, size, out=w_t[:-1])
    w_t[:-1] += ov
    w_t[-1] = size * fb
    v = np.zeros(ok.shape, order="F")
    np.multiply.outer(variance_factor(quant), c, out=v.T[:-1])
    if ok.all():  # quantised costs increase with the width: the first or full precision
        least = int(np.minimum(w[:, 0], w[:, -1]).sum())
    else:
        least = int(np.where(ok, w, np.iinfo(np.int64).max).min(axis=1).sum())
    if least > budget:
        avg = least / total if total else float("inf")
        raise ValueError(
            f"budget of {budget} bits is infeasible: the smallest allowed widths need {least} "
            f"bits, a minimum achievable average of {avg:.6g} bits per element"
        )
    solve = solve_exact if method == "exact" else solve_greedy
    col = solve(w, v, ok, budget)
    bits = np.where(col < quant.size, np.append(quant, 0)[col], fb)
    return _canonical(bits, c, size, ov, fb, ok)


def _canonical(
    bits: np.ndarray,
    c: np.ndarray,
    size: np.ndarray,
    ov: np.ndarray,
    fb: np.ndarray,
    ok: np.ndarray,
) -> np.ndarray:
    """Sort widths within classes of interchangeable items by decreasing sensitivity.

    Interchangeable items have identical costs and allowed widths, so permuting their widths
    keeps the cost; giving the widest to the most sensitive never increases the variance
    (rearrangement inequality, ``S`` decreasing), which makes the result monotone.
    """
    # Only items sharing their size with another can be interchangeable.
    by_size = np.argsort(size, kind="stable")
    sizes = size[by_size]
    dup = np.zeros(size.size, dtype=bool)
    dup[1:] = sizes[1:] == sizes[:-1]
    dup[:-1] |= dup[1:]
    sub = by_size[dup]
    if sub.size == 0:
        return bits
    out = bits.copy()
    out[sub] = _canonical_all(bits[sub], c[sub], size[sub], ov[sub], fb[sub], ok[sub])
    return out


def _canonical_all(
    bits: np.ndarray,
    c: np.ndarray,
    size: np.ndarray,
    ov: np.ndarray,
    fb: np.ndarray,
    ok: np.ndarray,
) -> np.ndarray:
    mask = (ok.astype(np.int64) << np.arange(ok.shape[1])).sum(axis=1)
    keys = (size, ov, fb, mask)
    order = np.lexsort((np.arange(c.size), -c, *reversed(keys)))
    new = np.ones(c.size, dtype=bool)
    new[1:] = np.any([k[order][1:] != k[order][:-1] for k in keys], axis=0)
    group = np.cumsum(new)
    ranked = bits[order][np.lexsort((-bits[order], group))]
    out = np.empty_like(bits)
    out[order] = ranked
    return out
