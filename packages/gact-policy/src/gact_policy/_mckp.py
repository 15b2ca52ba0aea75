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
_FILL_PASSES = 2  # passes of moves into the greedy's slack
_MIN_SEARCH = 6_000  # smallest automatic budget worth setting a search up for
_MOVE_COST = 2  # work units per (item, choice) a fill pass looks at (~0.1 us, page faults included)


def auto_max_states(n_items: int) -> int:
    """Default work budget: ~3.5 ms of search for small inputs, shrinking as the fixed cost of
    the greedy grows with the number of items; none from 9,000 items on (the search would not
    pay for its setup, and the greedy's gap is then typically below 1e-4 of the variance)."""
    units = 60_000 - 6 * n_items
    return units if units >= _MIN_SEARCH else 0


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
    if not exact or gap <= 0.0 or max_states == 0:
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
# The smaller the gap, the smaller the core, so the incumbent is improved first: the greedy is
# continued past the segment that did not fit (``_fill``: moves into the slack by efficiency),
# then the ``_NEAR`` items whose next choice is cheapest in reduced cost are re-optimised by the
# same DP (the others kept).
#
# The DP's size is not bounded by the input size (items of distinct sizes near the multiplier
# can leave thousands of core items and millions of states), so the search runs on a budget of
# *work units* (``max_states``, about one per DP state): fill passes, DP stages and their
# candidate states are charged before they run (NOTE [Pareto DP] for the beam a stage falls back
# to). When the budget cannot pay for a step the search stops and returns its incumbent, never
# worse than the greedy solution, with ``optimal`` False; the bound ``L(λ)`` still holds, so the
# caller can state the gap. Counting work (not time) keeps the result deterministic; time and
# memory are linear in items x choices plus the budget.
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
        try:
            self._fill()
            free = self._free()
            if np.count_nonzero(free.T.sum(axis=0, dtype=np.int32) > 1) > _NEAR:
                self._improve(self._near())
                free = self._free()
            # An item with one choice left keeps it (its Lagrangian minimiser, reduced cost 0).
            free_t = free.T
            fixed = free_t.sum(axis=0, dtype=np.int32) == 1
            column = np.arange(free.shape[1], dtype=np.int32)[:, None]
            self.best[fixed] = (free_t * column).sum(axis=0, dtype=np.int32)[fixed]
            return self._improve(np.flatnonzero(~fixed))
        except OutOfWork:
            return False

    def _free(self) -> np.ndarray:
        return self.red < self.gap * (1.0 + 1e-9) + self.tol

    def _fill(self) -> None:
        """Spend the greedy's slack (``best`` is the greedy solution), continuing the greedy past
        the segment that did not fit: each pass moves items to their most efficient heavier
        choice (variance removed per bit) in order of decreasing efficiency while the moves fit;
        the second pass revisits only the items that had a move that fit. A pass is skipped
        when the work budget cannot pay for it."""
        best = self.best
        slack = self.budget - int(self.w[np.arange(best.size), best].sum())
        items = None
        for _ in range(_FILL_PASSES):
            units = _MOVE_COST * self.w.size * (1.0 if items is None else items.size / best.size)
            if units > self.work.left:
                break
            self.work.spend(units)
            efficiency, to, extra = self._moves(items, slack)
            fits = np.flatnonzero(efficiency > 0.0)
            if fits.size == 0:
                break
            items = fits if items is None else items[fits]
            efficiency, to, extra = efficiency[fits], to[fits], extra[fits]
            order = np.argsort(-efficiency, kind="stable")
            taken = order[np.cumsum(extra[order]) <= slack]
            best[items[taken]] = to[taken]
            slack -= int(extra[taken].sum())
        rows = np.arange(best.size)
        self.gap = float(self.red[rows, best].sum()) + self.lam * slack

    def _moves(
        self, items: np.ndarray | None, slack: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per item (all if None): the most variance removed per bit by a heavier choice within
        ``slack`` bits (0 if none), that choice and its extra cost."""
        w_t, v_t, here = self.w.T, self.v.T, self.best
        if items is not None:
            w_t, v_t, here = w_t[:, items], v_t[:, items], here[items]
        cols = np.arange(here.size)
        w_here = w_t[here, cols]
        # Choices not allowed cost _BIG (NOTE [Lower convex hull]) and never fit the slack.
        extra = w_t - w_here
        with np.errstate(divide="ignore", invalid="ignore"):
            efficiency = np.where(
                (extra > 0) & (extra <= slack), (v_t[here, cols] - v_t) / extra, 0.0
            )
        # Row by row: numpy's argmax over the short leading axis is several times slower.
        top, to = efficiency[0].copy(), np.zeros(here.size, dtype=np.intp)
        for j in range(1, efficiency.shape[0]):
            better = efficiency[j] > top
            top = np.where(better, efficiency[j], top)
            to[better] = j
        return top, to, extra[to, cols]

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

    def _improve(self, items: np.ndarray) -> bool:
        """Re-optimise ``items`` (the others kept) if that beats the incumbent; True if the
        result is optimal for them (the DP left no state out)."""
        w, red, best = self.w, self.red, self.best
        rows = np.arange(best.size)
        cap = self.budget - int(w[rows, best].sum()) + int(w[items, best[items]].sum())
        limit = self.gap * (1.0 + 1e-9)
        free = self.ok[items] & (red[items] < limit + self.tol[items])
        picked, exact = pareto_dp(w[items], red[items], free, cap, self.lam, limit, self.work)
        if picked is not None:
            best[items] = picked
            self.gap = float(red[rows, best].sum()) + self.lam * (
                self.budget - int(w[rows, best].sum())
            )
        return exact
