"""Variance-minimising bit allocation under a memory budget.

Each item ``l`` (a saved activation, a weight matrix, ...) has ``numel[l]`` elements and a
sensitivity ``c[l]``. Giving it ``b`` bits costs ``numel·(b + overhead_bits[l])`` bits (rounded up
to whole bits per item) when quantised and ``numel·full_bits[l]`` bits at full precision, and adds
``c[l]·S(b)`` to the predicted gradient variance (:func:`gact_policy.variance_factor`).
:func:`allocate` minimises ``Σ c_l S(b_l)`` subject to ``Σ cost_l <= budget``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
from numpy.typing import ArrayLike

from . import _problem
from ._checks import integer_array, integer_scalar, per_item
from ._mckp import auto_max_states, solve
from ._pareto import row_hash
from .variance import variance_factor

__all__ = [
    "Allocation",
    "InfeasibleBudgetError",
    "allocate",
    "allocate_bits",
    "min_storage_bits",
    "storage_bits",
]

_IntLike = Union[int, ArrayLike]


class InfeasibleBudgetError(ValueError):
    """The budget cannot hold even the narrowest allowed width of every item.

    Attributes:
        budget_bits: the budget that was asked for.
        min_bits: the smallest feasible budget (:func:`min_storage_bits`).
    """

    def __init__(self, budget_bits: int, min_bits: int, total_numel: int) -> None:
        self.budget_bits, self.min_bits = budget_bits, min_bits
        avg = min_bits / total_numel if total_numel else math.inf
        super().__init__(
            f"budget of {budget_bits} bits is infeasible: the smallest allowed widths need "
            f"{min_bits} bits ({-(-min_bits // 8)} bytes), a minimum achievable average of "
            f"{avg:.6g} bits per element; raise avg_bits or budget_bytes, or allow narrower "
            "widths (choices, lower, pinned). min_storage_bits() computes this minimum."
        )


@dataclass(frozen=True)
class Allocation:
    """Result of :func:`allocate`.

    ``variance`` and ``lower_bound`` are in units of the largest finite sensitivity (the
    allocation is scale-free; non-finite sensitivities count as 2): multiply by it for the
    caller's units, or use :func:`gact_policy.predicted_variance`.

    Attributes:
        bits: int64 width per item (read-only); full precision is reported as ``full_bits``.
        storage_bits: cost of ``bits`` in bits, ``<= budget_bits``.
        budget_bits: the budget in bits.
        variance: predicted variance ``Σ c_l S(b_l)`` of ``bits``.
        lower_bound: a proven lower bound on the smallest achievable ``variance``.
        optimal: True if ``bits`` is proven optimal (``lower_bound == variance``).

    Example:
        >>> a = allocate([1.0, 100.0], [1000, 1000], 4.0)
        >>> a.bits.tolist(), a.optimal, a.gap
        ([3, 5], True, 0.0)
    """

    bits: np.ndarray
    storage_bits: int
    budget_bits: int
    variance: float
    lower_bound: float
    optimal: bool

    @property
    def gap(self) -> float:
        """``variance - lower_bound``: how much worse than optimal ``bits`` can be, at most."""
        return self.variance - self.lower_bound

    @property
    def relative_gap(self) -> float:
        """``gap / variance`` (0 when the variance is 0)."""
        return self.gap / self.variance if self.variance > 0.0 else 0.0


def storage_bits(
    numel: ArrayLike, bits: ArrayLike, *, full_bits: _IntLike = 32, overhead_bits: ArrayLike = 0.0
) -> int:
    """Exact storage cost in bits that :func:`allocate_bits` charges for an allocation.

    Args:
        numel: element count per item (1-D, ``>= 0``).
        bits: width per item (or one for all); ``>= FULL_PRECISION`` means full precision.
        full_bits: original width, scalar or per item, charged for full precision.
        overhead_bits: metadata bits per element, scalar or per item, charged to quantised
            items only; ``ceil(numel·overhead_bits)`` bits per item.

    Returns:
        Total cost in bits.

    Raises:
        TypeError: on non-numeric or boolean arguments.
        ValueError: on a negative size, a width below 1 or a length mismatch.

    Example:
        >>> storage_bits([256, 256], [4, 32], overhead_bits=0.25)
        9280
    """
    size = integer_array(numel, "numel")
    if np.any(size < 0):
        raise ValueError(f"numel must be >= 0, got {int(size.min())}")
    widths = per_item(bits, size.size, "bits", integer=True)
    if widths.size and widths.min() < 1:
        raise ValueError(f"bits must be >= 1, got {int(widths.min())}")
    fb = per_item(full_bits, size.size, "full_bits", integer=True)
    return int(_problem.item_costs(size, widths, fb, overhead_bits).sum())


def min_storage_bits(
    numel: ArrayLike,
    *,
    choices: Optional[Sequence[int]] = None,
    full_bits: _IntLike = 32,
    overhead_bits: ArrayLike = 0.0,
    lower: Optional[_IntLike] = None,
    upper: Optional[_IntLike] = None,
    pinned: Optional[ArrayLike] = None,
) -> int:
    """Smallest budget in bits that :func:`allocate_bits` accepts: every item at its cheapest
    allowed width.

    A caller whose budget is smaller can warn and allocate with this budget instead (the
    smallest allocation), e.g. ``budget_bytes=-(-min_storage_bits(...) // 8)``.

    Args:
        numel: element count per item (1-D, ``>= 0``).
        choices, full_bits, overhead_bits, lower, upper, pinned: as for
            :func:`allocate_bits`.

    Returns:
        The minimum cost in bits.

    Raises:
        TypeError: on non-numeric or boolean arguments.
        ValueError: on invalid values, or an item with no allowed width.

    Example:
        >>> min_storage_bits([1000, 1000], overhead_bits=0.25)
        2500
        >>> min_storage_bits([1000, 1000], choices=[2, 4], pinned=[0, 32])
        34000
    """
    c = _problem.costs(
        numel,
        None,
        choices=choices,
        full_bits=full_bits,
        overhead_bits=overhead_bits,
        lower=lower,
        upper=upper,
        pinned=pinned,
    )
    return c.least


def allocate(
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
    max_states: Union[int, str, None] = "auto",
) -> Allocation:
    """Choose a width per item minimising ``Σ c_l S(b_l)`` within a memory budget.

    Like :func:`allocate_bits` (see there for the arguments and semantics), but returns an
    :class:`Allocation` that also states how close to optimal the widths are.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> a = allocate(rng.lognormal(size=500), rng.integers(1000, 10**6, 500), 3.0)
        >>> a.storage_bits <= a.budget_bits, a.relative_gap < 1e-3
        (True, True)
    """
    scaled = _problem.scaled_sensitivity(sensitivity)
    n = scaled.size
    if method not in ("exact", "greedy"):
        raise ValueError(f"method must be 'exact' or 'greedy', got {method!r}")
    if isinstance(max_states, str):
        if max_states != "auto":
            raise ValueError(
                f"max_states must be 'auto', an integer >= 0 or None, got {max_states!r}"
            )
        max_states = auto_max_states(n)
    elif max_states is not None:
        max_states = integer_scalar(max_states, "max_states")
        if max_states < 0:
            raise ValueError(
                f"max_states must be 'auto', an integer >= 0 or None, got {max_states}"
            )
    costs = _problem.costs(
        numel,
        n,
        choices=choices,
        full_bits=full_bits,
        overhead_bits=overhead_bits,
        lower=lower,
        upper=upper,
        pinned=pinned,
    )
    total = int(costs.size.sum())
    budget = _problem.budget_bits(avg_bits, budget_bytes, total)
    if costs.least > budget:
        raise InfeasibleBudgetError(budget, costs.least, total)
    if n == 0:
        return Allocation(_frozen(np.zeros(0, np.int64)), 0, budget, 0.0, 0.0, True)
    sol = solve(
        costs.w,
        costs.values(scaled),
        costs.ok,
        min(budget, costs.most),
        exact=method == "exact",
        max_states=max_states,
    )
    choice = _cheapest_when_insensitive(_canonical(sol.choice, scaled, costs), scaled, costs)
    bits = costs.bits(choice)
    variance = float(np.sum(scaled * variance_factor(bits)))
    used = int(costs.w[np.arange(n), choice].sum())
    bound = variance if sol.optimal else min(sol.lower_bound, variance)
    return Allocation(_frozen(bits), used, budget, variance, bound, sol.optimal)


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


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
    max_states: Union[int, str, None] = "auto",
) -> np.ndarray:
    """Choose a width per item minimising ``Σ c_l S(b_l)`` within a memory budget.

    Semantics: full precision is requested with any width ``>= FULL_PRECISION`` in ``choices``
    and reported as the item's ``full_bits``. A quantised item ``l`` costs
    ``numel_l·b + ceil(numel_l·overhead_bits_l)`` bits, a full-precision one
    ``numel_l·full_bits_l`` (:func:`storage_bits`). The budget is ``floor(avg_bits·Σ numel)``
    bits or ``8·budget_bytes``; the result never exceeds it. Sensitivities are scale-free;
    NaN/+inf count as twice the largest finite value (most sensitive). Among equally good
    allocations, interchangeable items (same size, bounds and costs) get widths in order of
    decreasing sensitivity, ties to the lower index, so the result is deterministic and
    monotone; items of zero sensitivity take their cheapest allowed width, so budget left over
    is not spent on them.

    The time and memory are bounded for every input (see ``max_states``); :func:`allocate`
    also reports whether the result is proven optimal and its largest possible distance from
    the optimum.

    Args:
        sensitivity: ``c_l >= 0`` per item, 1-D (NaN/+inf allowed, see above).
        numel: element count per item (``>= 0``; zero-size items cost nothing).
        avg_bits: budget in bits per element over all items (including overhead), or None when
            ``budget_bytes`` is given.
        choices: allowed widths (default 1..8 and full precision).
        method: ``"exact"`` (the greedy, improved and, when the search fits in ``max_states``,
            proven optimal) or ``"greedy"`` (the hull greedy alone: optimal when the budget
            lands on a breakpoint, otherwise within ``λ·slack``).
        budget_bytes: alternative absolute budget in bytes (pass ``avg_bits=None``), e.g. the
            memory left after the tensors that cannot be quantised.
        full_bits: original width, scalar or per item (``>= FULL_PRECISION``).
        overhead_bits: metadata bits per element of a quantised item, scalar or per item, e.g.
            ``64/256`` for a float32 ``(lo, scale)`` pair per group of 256, plus 1 for an exact
            decision mask.
        lower: smallest allowed reported width, scalar or per item.
        upper: largest allowed reported width, scalar or per item (``upper=8`` forbids full
            precision).
        pinned: per-item width, 0 for free items; a pin overrides choices and bounds (a pin
            ``>= FULL_PRECISION`` means full precision, reported as ``full_bits``).
        max_states: work budget of the exact search, about one unit per DP state. ``"auto"``
            (default): ``60,000 - 6·items`` units, none from 9,000 items on (the greedy is then
            returned with its gap), about 3.5 ms of search at most on a 2-core machine; an
            integer: that many (0: no search); None: unlimited, which can take minutes and
            gigabytes on large inputs.

    Returns:
        int64 array of widths (full precision as ``full_bits``).

    Raises:
        InfeasibleBudgetError: if the budget is below :func:`min_storage_bits` (a
            ``ValueError``; the message states the minimum).
        TypeError: on non-numeric or boolean arguments.
        ValueError: on other invalid input, or an item with no allowed width.

    Example:
        >>> allocate_bits([1.0, 100.0], [1000, 1000], 4.0).tolist()
        [3, 5]
        >>> allocate_bits(  # 1000·(2 + 0.25) + 1000·(3 + 2) = 7250 bits <= 8·1000
        ...     [1.0, 2.0], [1000, 1000], None, budget_bytes=1000, overhead_bits=[0.25, 2.0]
        ... ).tolist()
        [2, 3]
    """
    result = allocate(
        sensitivity,
        numel,
        avg_bits,
        choices=choices,
        method=method,
        budget_bytes=budget_bytes,
        full_bits=full_bits,
        overhead_bits=overhead_bits,
        lower=lower,
        upper=upper,
        pinned=pinned,
        max_states=max_states,
    )
    return result.bits.copy()  # writeable, as it always was (Allocation.bits is read-only)


def _canonical(choice: np.ndarray, c: np.ndarray, costs: _problem.Costs) -> np.ndarray:
    """Sort the choices within classes of interchangeable items by decreasing sensitivity.

    Interchangeable items have identical costs and allowed choices, so permuting their choices
    keeps the cost; giving the widest (columns are ordered by width, full precision last) to the
    most sensitive (ties: the lower index) never increases the variance (rearrangement
    inequality, ``S`` decreasing), which makes the result deterministic and monotone.
    """
    _, inverse, counts = np.unique(costs.size, return_inverse=True, return_counts=True)
    sub = np.flatnonzero(counts[inverse.reshape(-1)] > 1)  # only equal sizes can swap
    if sub.size == 0:
        return choice
    mask = np.zeros(sub.size, dtype=np.int64)
    for j, allowed in enumerate(costs.ok.T[:, sub]):
        mask |= allowed.astype(np.int64) << j
    keys = np.stack([costs.size[sub], costs.w[sub, 0], costs.w[sub, -1], mask])
    group = _classes(keys)
    # One sort of unique integers (class, rank of decreasing sensitivity, index) instead of a
    # lexsort: numpy's stable sorts of floats are several times slower.
    rank = np.unique(c[sub], return_inverse=True)[1].reshape(-1)
    top, k = int(rank.max()) + 1, sub.size
    order = np.sort((group * top + (top - 1 - rank)) * k + np.arange(k)) % k
    width = costs.ok.shape[1]
    ranked = np.sort(group[order] * width + (width - 1 - choice[sub[order]]))
    out = choice.copy()
    out[sub[order]] = width - 1 - ranked % width
    return out


def _cheapest_when_insensitive(
    choice: np.ndarray, c: np.ndarray, costs: _problem.Costs
) -> np.ndarray:
    """Items of zero sensitivity at their cheapest allowed choice.

    Their width adds no variance, so any is optimal; a budget with room to spare would
    otherwise leave them wide (a tensor saved only for its shape, or read only through an exact
    decision). The variance is unchanged and the storage never grows; a choice already as cheap
    as any stays.
    """
    rows = np.flatnonzero(c == 0.0)
    if rows.size == 0:
        return choice
    w = np.where(costs.ok[rows], costs.w[rows], np.iinfo(np.int64).max)
    dearer = w[np.arange(rows.size), choice[rows]] > w.min(axis=1)
    out = choice.copy()
    out[rows[dearer]] = w[dearer].argmin(axis=1)
    return out


def _classes(keys: np.ndarray) -> np.ndarray:
    """Dense class number of every column of ``keys`` (equal columns, equal class)."""
    group = np.unique(row_hash(keys.T), return_inverse=True)[1].reshape(-1)
    member = np.empty(int(group.max()) + 1, dtype=np.intp)
    member[group] = np.arange(group.size)
    if np.any(keys != keys[:, member[group]]):  # a hash collision: group by the keys exactly
        order = np.lexsort(keys[::-1])
        new = np.ones(group.size, dtype=bool)
        new[1:] = (keys[:, order][:, 1:] != keys[:, order][:, :-1]).any(axis=0)
        group[order] = np.cumsum(new) - 1
    return group
