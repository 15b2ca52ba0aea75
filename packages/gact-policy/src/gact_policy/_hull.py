"""Lower convex hulls of the items' choices and the hull greedy (private)."""

from __future__ import annotations

import numpy as np

__all__ = ["Hull"]

_BIG = np.iinfo(np.int64).max  # cost of a choice that is not allowed
_BUCKET_SHIFT = 45  # keep sign, exponent and 7 mantissa bits of an efficiency as its bucket


# NOTE [Lower convex hull]
# Per item, the lower convex hull of its points ``(w, v)`` (cost in bits, predicted variance)
# starting at the lightest point; its segments have non-increasing *efficiency* (variance removed
# per bit added). It is built for all items at once: the points are sorted by cost (a no-op for
# the allocator's matrices) and every point that is dominated (heavier, not lower) or lies above
# the chord of its neighbours is removed, all items and all such points in one vectorised pass.
# Each removed point is provably not a hull vertex (it lies above a chord of two points), and
# when a pass removes nothing the chain is convex, so it is the hull. For the allocator's inputs
# (``S(b)`` is convex, so all quantised points are already in convex position) one pass over
# adjacent differences settles almost every item; only items whose full-precision point cuts off
# quantised points are iterated, on their own (``_hull_rows``).
# Choices that are not allowed get the cost ``_BIG``: they sort last and never fit a budget.
#
# Inputs are expected choice-major (Fortran order, as the allocator builds them): reductions over
# an item's few choices then run along contiguous memory, which is an order of magnitude faster
# in numpy than reducing along a short inner axis; any layout gives the same result.


class Hull:
    """Sorted choices, hull vertices and the hull segment ending at every vertex."""

    def __init__(self, w: np.ndarray, v: np.ndarray, ok: np.ndarray) -> None:
        n_choices = w.shape[1]
        every = bool(ok.all())
        wk = w if every else np.where(ok, w, _BIG)
        step = np.diff(wk, axis=1)
        rising = step > 0
        if rising.all() if every else np.all(rising | ((step == 0) & (wk[:, 1:] == _BIG))):
            self.order = None  # already sorted, allowed choices first
            self.w, self.v, self.ok = wk, v, ok
        else:
            wider_first = np.broadcast_to(-np.arange(n_choices), w.shape)
            self.order = np.lexsort((wider_first, v, wk), axis=-1)
            self.w = np.take_along_axis(wk, self.order, 1)
            self.v = np.take_along_axis(v, self.order, 1)
            self.ok = np.take_along_axis(ok, self.order, 1)
            step = np.diff(self.w, axis=1)
            rising = step > 0
            every = False
        # One pass on adjacent points: in the allocator's matrices nearly every item is convex.
        # ``every``: all choices allowed and strictly increasing in cost, so all are segments.
        dv = self.v[:, :-1] - self.v[:, 1:]
        if every:
            bad = dv < 0
        else:
            seg = self.ok[:, 1:]  # allowed choices form a prefix, so both ends are allowed
            bad = seg & (~rising | (dv < 0))
        with np.errstate(divide="ignore", invalid="ignore"):
            eff = np.divide(dv, step, out=dv)  # in place: fewer large temporaries
        if not every:
            eff[~(seg & rising)] = -np.inf
            bad[:, :-1] |= seg[:, :-1] & (eff[:, :-1] < eff[:, 1:])
        else:
            bad[:, :-1] |= eff[:, :-1] < eff[:, 1:]
        self.keep, self.eff, self.dw = self.ok, eff, step  # dw is only read at segments
        self.all_segments = every
        if bad.any():
            rows = np.flatnonzero(bad.any(axis=1))
            keep, eff_r, dw_r = _hull_rows(self.w[rows], self.v[rows], self.ok[rows])
            self.keep = self.ok.copy()
            self.keep[rows], self.eff[rows], self.dw[rows] = keep, eff_r, dw_r
            self.all_segments = False

    def greedy(self, budget: int) -> tuple[np.ndarray, float]:
        """Sorted-column choice of the hull greedy and its multiplier ``λ`` (0 if all fit).

        See NOTE [Hull greedy].
        """
        n_items = self.w.shape[0]
        seg_t = self.keep.T[1:]  # (level column, item): a view for the Fortran-order input
        # Segments in column-major order: flat index = (column - 1) * n_items + item.
        flat = None if self.all_segments else np.flatnonzero(seg_t)
        room = budget - int(self.w[:, 0].sum())
        dw = self.dw.T.ravel()
        if flat is not None:
            dw = dw[flat]
        if int(dw.sum()) <= room:
            taken, lam = np.ones(dw.size, dtype=bool), 0.0
        else:
            eff = self.eff.T.ravel()
            if flat is not None:
                eff = eff[flat]
            taken, lam = _critical(eff, dw, flat, seg_t, room)
        # Taken segments are a prefix of each item's hull.
        if flat is None:  # every column is a vertex: the choice is the segment count
            return taken.reshape(seg_t.shape).sum(axis=0, dtype=np.int64), lam
        counts = np.bincount(flat[taken] % n_items, minlength=n_items)
        rank = np.cumsum(self.keep, axis=1) - 1  # vertex number of each kept column
        return np.argmax(self.keep & (rank == counts[:, None]), axis=1), lam

    def to_original(self, choice: np.ndarray) -> np.ndarray:
        if self.order is None:
            return choice
        return self.order[np.arange(choice.size), choice]


def _hull_rows(
    w: np.ndarray, v: np.ndarray, ok: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lower-left hull of sorted rows by repeated removal of points that are not vertices.

    Returns the vertex mask and, for columns ``1..m-1``, the efficiency and cost step of the
    segment ending at each vertex (``-inf`` and 0 elsewhere).
    """
    k, m = w.shape
    cols = np.arange(m)
    keep = ok.copy()
    while True:
        prev = np.maximum.accumulate(np.where(keep, cols, -1), axis=1)
        prev = np.concatenate([np.full((k, 1), -1), prev[:, :-1]], axis=1)
        nxt = np.minimum.accumulate(np.where(keep, cols, m)[:, ::-1], axis=1)[:, ::-1]
        nxt = np.concatenate([nxt[:, 1:], np.full((k, 1), m)], axis=1)
        has_prev = keep & (prev >= 0)
        pc = np.maximum(prev, 0)
        dw = np.where(has_prev, w - np.take_along_axis(w, pc, 1), 0)
        dv = np.take_along_axis(v, pc, 1) - v
        with np.errstate(divide="ignore", invalid="ignore"):
            eff = np.where(has_prev & (dw > 0), dv / np.maximum(dw, 1), -np.inf)
        eff_out = np.where(nxt < m, np.take_along_axis(eff, np.minimum(nxt, m - 1), 1), -np.inf)
        bad = has_prev & ((dw <= 0) | (dv < 0) | (eff < eff_out))
        if not bad.any():
            return keep, eff[:, 1:], dw[:, 1:]
        keep &= ~bad


# NOTE [Hull greedy]
# Taking all segments of all items in order of decreasing efficiency while the budget holds gives
# a solution ``x_G`` that minimises the Lagrangian ``Σ (v + λ w)`` at the multiplier ``λ`` =
# efficiency of the first segment that did not fit (the *critical* segment). By Everett's theorem
# ``x_G`` is optimal for the budget ``W(x_G)`` it uses, and the LP (convex-hull) relaxation has
# value ``L(λ) = V(x_G) - λ·(B - W(x_G))``, a lower bound on every feasible solution. Hence the
# greedy is optimal whenever its slack ``B - W(x_G)`` is zero or ``λ = 0``, and in general
# ``V(x_G) - OPT <= λ·slack``.
#
# The segments are not sorted: their efficiencies are bucketed by the top bits of their IEEE-754
# representation (monotone for non-negative floats), one weighted ``bincount`` locates the bucket
# holding the critical segment, and only that bucket is sorted (by efficiency, then hull level,
# then item). The budget arithmetic is re-checked in exact integers and falls back to a full sort
# if floating-point sums disagree, so the result is the same as sorting all segments.


def _critical(
    eff: np.ndarray, dw: np.ndarray, flat: np.ndarray | None, seg_t: np.ndarray, room: int
) -> tuple[np.ndarray, float]:
    """Segments taken by the greedy (decreasing efficiency, ties by level then item) and ``λ``.

    Requires ``Σ dw > room``. Only the bucket of efficiencies holding the critical segment is
    sorted; the integer re-check falls back to sorting everything.
    """
    key = eff.view(np.int64) >> _BUCKET_SHIFT  # monotone for eff >= 0
    low = int(key.min())
    if low < 0:  # -0.0 (or a negative efficiency): the bucket of +0.0
        key, low = np.maximum(key, 0), 0
    key -= low
    hist = np.bincount(key, weights=dw)
    fits = int(np.searchsorted(np.cumsum(hist[::-1]), room, side="right"))
    crit = hist.size - 1 - fits
    taken = key > crit
    used = int(np.sum(dw, where=taken))
    sub = np.flatnonzero(key == crit)
    if crit < 0 or used > room or used + int(dw[sub].sum()) <= room:
        taken[:] = False
        used, sub = 0, np.arange(eff.size)
    col, row = np.divmod(sub if flat is None else flat[sub], seg_t.shape[1])
    level = np.cumsum(seg_t[:, row], axis=0)[col, np.arange(row.size)]  # hull level + 1
    order = sub[np.lexsort((row, level, -np.maximum(eff[sub], 0.0)))]
    p = int(np.searchsorted(used + np.cumsum(dw[order]), room, side="right"))
    taken[order[:p]] = True
    return taken, max(float(eff[order[p]]), 0.0)
