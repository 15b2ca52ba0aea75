"""Bounded search for the multiple-choice knapsack behind :func:`gact_policy.allocate` (private).

Problem: items ``l`` with choices ``j`` of integer cost ``w[l, j]`` (bits) and value ``v[l, j]``
(predicted variance); pick one allowed choice per item minimising ``Σ v`` subject to ``Σ w <= B``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._hull import Hull
from ._pareto import OutOfWork, Work, pareto_dp

__all__ = ["Solution", "auto_max_states", "solve"]

_NEAR = 12  # items re-optimised around the multiplier before the reduced-cost fixing
_FILL_PASSES = 4  # passes of single-item moves into the greedy's slack


def auto_max_states(n_items: int) -> int:
    """Default work budget: ~3.5 ms of search for small inputs, shrinking as the fixed cost of
    the greedy grows with the number of items (~0.5 ms of search at 10,000 items)."""
    return max(10_000, 60_000 - 5 * n_items)


@dataclass(frozen=True)
class Solution:
    """Chosen original column per item, a proven lower bound on ``Σ v`` and whether optimal."""

    choice: np.ndarray
    lower_bound: float
    optimal: bool


def solve(
    w: np.ndarray,
    v: np.ndarray,
    ok: np.ndarray,
    budget: int,
    *,
    exact: bool,
    max_states: int | None,
) -> Solution:
    """Hull greedy, then (``exact``) the bounded search of NOTE [Bounded exact search]."""
    hull = Hull(w, v, ok)
    choice, lam = hull.greedy(budget)
    rows = np.arange(w.shape[0])
    slack = budget - int(hull.w[rows, choice].sum())
    gap = lam * slack
    bound = float(hull.v[rows, choice].sum()) - gap
    if not exact or gap <= 0.0:
        return Solution(hull.to_original(choice), bound, gap <= 0.0)
    search = _Search(hull, lam, budget, max_states, choice, gap)
    optimal = search.run()
    return Solution(hull.to_original(search.best), bound, optimal)


# NOTE [Bounded exact search]
# For any feasible ``x``: ``V(x) = L(λ) + Σ_l r[l, x_l] + λ·slack(x)`` with reduced costs
# ``r[l, j] = v + λ w - min_k (v + λ w)[l, k] >= 0`` (NOTE [Hull greedy] for ``λ`` and the bound
# ``L(λ)``). A solution beats the incumbent only if ``Σ r + λ·slack < gap``, the incumbent's
# own value of that sum, so every choice with ``r >= gap`` is eliminated (reduced-cost fixing).
# Items left with one choice are fixed; the remaining *core* items are solved by the Pareto-list
# dynamic programme of ``_pareto.py``, whose prunings are all valid bounds: a DP that runs to the
# end proves its result optimal (up to floating-point rounding, relative ``1e-9`` of the gap).
#
# The smaller the gap, the smaller the core, so the incumbent is improved first: the greedy's
# slack is spent by single-item moves (``_fill``), then the ``_NEAR`` items whose next choice is
# cheapest in reduced cost are re-optimised by the same DP (the others kept).
#
# The DP's size is not bounded by the input size (items of distinct sizes near the multiplier
# can leave thousands of core items and millions of states), so the search runs on a budget of
# *work units* (``max_states``): every DP stage is charged its candidate states before they are
# materialised, plus a fixed cost per stage. When the budget would be exceeded the search stops
# and returns its incumbent, never worse than the greedy solution, with ``optimal`` False; the
# bound ``L(λ)`` still holds, so the caller can state the gap. Counting work (not time) keeps the
# result deterministic; time and memory are linear in items x choices plus the budget.
#
# Which instances are proven optimal: those whose search fits the budget. A core of ``k`` items
# with ``m_i`` free choices needs at most ``k`` stages and ``2·Π m_i`` states, so the default
# budget proves every instance of up to 4 items with the 9 default widths; beyond that it
# depends on the core (``benchmarks/bench_policy.py`` reports the proven fraction per family).


class _Search:
    """Incumbent, reduced costs and work budget of one bounded search."""

    def __init__(
        self,
        hull: Hull,
        lam: float,
        budget: int,
        max_states: int | None,
        choice: np.ndarray,
        gap: float,
    ) -> None:
        self.w, self.v, self.ok, self.lam, self.budget = hull.w, hull.v, hull.ok, lam, budget
        self.work = Work(max_states)
        self.best, self.gap = choice.copy(), gap
        # Reductions over the few choices of every item run along the transposed (choice-major)
        # view: contiguous for the allocator's Fortran-order matrices, and many times faster than
        # numpy's reductions along a short inner axis. Large temporaries are updated in place.
        lagr = hull.w.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            lagr *= lam
            lagr += hull.v
        if hull.ok.all():
            scale = lagr.T.max(axis=0)
        else:
            lagr[~hull.ok] = np.inf
            scale = np.where(hull.ok, lagr, 0.0).T.max(axis=0)
        self.tol = 1e-12 * scale[:, None]  # lagr >= 0: costs and values are non-negative
        lagr -= lagr.T.min(axis=0)[:, None]
        self.red = lagr  # reduced costs >= 0; inf where not allowed

    def run(self) -> bool:
        """Improve ``best`` within the work budget; True if it is proven optimal."""
        self._fill()
        try:
            free = self._free()
            if np.count_nonzero(free.T.sum(axis=0, dtype=np.int32) > 1) > _NEAR:
                self._improve(self._near())
                free = self._free()
            # An item with one choice left keeps it (its Lagrangian minimiser, reduced cost 0).
            free_t = free.T
            fixed = free_t.sum(axis=0, dtype=np.int32) == 1
            column = np.arange(free.shape[1], dtype=np.int32)[:, None]
            self.best[fixed] = (free_t * column).sum(axis=0, dtype=np.int32)[fixed]
            self._improve(np.flatnonzero(~fixed))
        except OutOfWork:
            return False
        return True

    def _free(self) -> np.ndarray:
        return self.red < self.gap * (1.0 + 1e-9) + self.tol

    def _fill(self) -> None:
        """Spend the greedy's slack (``best`` is the greedy solution): every item's best move to
        a heavier choice that fits (most variance removed) is taken in order of decreasing gain
        while it fits, in a few passes over the moves that still fit (one move per item)."""
        best, w_t, v_t = self.best, self.w.T, self.v.T
        cols = np.arange(best.size)
        here = w_t[best, cols]
        slack = self.budget - int(here.sum())
        # Choices not allowed cost _BIG (NOTE [Lower convex hull]), so they never fit, and no
        # lighter choice has less variance than a hull vertex: only heavier ones gain.
        gain = np.where(w_t <= here + slack, v_t[best, cols] - v_t, 0.0)
        to = np.argmax(gain, axis=0)
        gain, extra = gain[to, cols], w_t[to, cols] - here
        moves = np.flatnonzero(gain > 0.0)
        moves = moves[np.argsort(-gain[moves], kind="stable")]
        for _ in range(_FILL_PASSES):
            moves = moves[extra[moves] <= slack]
            if moves.size == 0:
                break
            used = np.cumsum(extra[moves])
            take = int(np.searchsorted(used, slack, side="right"))  # >= 1: the first fits
            best[moves[:take]] = to[moves[:take]]
            slack -= int(used[take - 1])
            moves = moves[take:]
        self.gap = float(self.red[cols, best].sum()) + self.lam * slack

    def _near(self) -> np.ndarray:
        """The ``_NEAR`` items whose cheapest other choice has the smallest reduced cost."""
        rows = np.arange(self.best.size)
        at_best = self.red[rows, self.best]
        self.red[rows, self.best] = np.inf
        nearest = self.red.T.min(axis=0)
        self.red[rows, self.best] = at_best
        kth = np.partition(nearest, _NEAR - 1)[_NEAR - 1]
        near = np.flatnonzero(nearest <= kth)
        return near[np.argsort(nearest[near], kind="stable")[:_NEAR]]

    def _improve(self, items: np.ndarray) -> None:
        """Re-optimise ``items`` (the others kept) if that beats the incumbent."""
        w, red, best = self.w, self.red, self.best
        rows = np.arange(best.size)
        cap = self.budget - int(w[rows, best].sum()) + int(w[items, best[items]].sum())
        limit = self.gap * (1.0 + 1e-9)
        free = self.ok[items] & (red[items] < limit + self.tol[items])
        picked = pareto_dp(w[items], red[items], free, cap, self.lam, limit, self.work)
        if picked is None:
            return
        best[items] = picked
        self.gap = float(red[rows, best].sum()) + self.lam * (
            self.budget - int(w[rows, best].sum())
        )
