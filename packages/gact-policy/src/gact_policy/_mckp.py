"""Solvers for the multiple-choice knapsack behind :func:`gact_policy.allocate_bits`.

Problem: items ``l`` with choices ``j`` of integer cost ``w[l, j]`` (bits) and value ``v[l, j]``
(predicted variance); pick one allowed choice per item minimising ``Σ v`` subject to ``Σ w <= B``.

*Hull greedy.* Per item, the lower convex hull of its points ``(w, v)`` starting at the lightest
point is traced by gift wrapping; its segments have non-increasing *efficiency* (variance removed
per bit added). Taking all segments of all items in order of decreasing efficiency while the
budget holds gives a solution ``x_G`` that minimises the Lagrangian ``Σ (v + λ w)`` at the
multiplier ``λ`` = efficiency of the first segment that did not fit (the *critical* segment). By
Everett's theorem ``x_G`` is optimal for the budget ``W(x_G)`` it uses, and the LP (convex-hull)
relaxation has value ``L(λ) = V(x_G) - λ·(B - W(x_G))``. Hence greedy is optimal whenever its
slack ``B - W(x_G)`` is zero (the budget lands on a hull breakpoint) or ``λ = 0``, and in general
``V(x_G) - OPT <= λ·slack``.

*Exact.* For any feasible ``x``: ``V(x) = L(λ) + Σ_l r[l, x_l] + λ·slack(x)`` with reduced costs
``r[l, j] = v + λ w - min_k (v + λ w)[l, k] >= 0``. A solution beats the incumbent ``x_G`` only
if ``Σ r + λ·slack < gap := λ·slack(x_G)``, so every choice with ``r >= gap`` is eliminated
(reduced-cost fixing). Items left with one choice are fixed; the few *core* items (slopes near
``λ``) are solved by a Pareto-list dynamic programme (Nemhauser-Ullmann) that keeps, after each
item, the non-dominated partial states ``(weight, Σ r + λ·(B' - weight))`` and prunes states with
``Σ r >= gap``, states that cannot fit, and states that cannot fill the budget closely enough.
All prunings are valid bounds, so the result is optimal (up to floating-point rounding, relative
``1e-9`` of the gap). Its cost is that of the greedy plus the DP on the core, which is tiny unless
many items tie at the multiplier.
"""

from __future__ import annotations

import numpy as np

__all__ = ["solve_exact", "solve_greedy"]

_BIG = np.iinfo(np.int64).max
_HEURISTIC_CORE = 12


class _Hull:
    """Sorted choices, hull vertices per level and hull segments of every item."""

    def __init__(self, w: np.ndarray, v: np.ndarray, ok: np.ndarray) -> None:
        n_items, n_choices = w.shape
        wider_first = np.broadcast_to(-np.arange(n_choices), w.shape)
        wk = np.where(ok, w, _BIG)
        step = np.diff(wk, axis=1)
        if np.all((step > 0) | ((step == 0) & (wk[:, 1:] == _BIG))):
            self.order = np.broadcast_to(np.arange(n_choices), w.shape)  # already sorted
        else:
            self.order = np.lexsort((wider_first, v, wk), axis=-1)
        rows = np.arange(n_items)
        self.w = np.take_along_axis(wk, self.order, 1)
        self.v = np.take_along_axis(v, self.order, 1)
        self.ok = np.take_along_axis(ok, self.order, 1)
        cols = np.arange(n_choices)
        cur = np.zeros(n_items, dtype=np.int64)
        prev_eff = np.full(n_items, np.inf)
        vertices = [cur]
        seg_row, seg_level, seg_dw, seg_eff = [], [], [], []
        wf = self.w.astype(np.float64)
        for level in range(n_choices - 1):
            wc, vc = self.w[rows, cur], self.v[rows, cur]
            cand = (
                self.ok & (cols > cur[:, None]) & (self.w > wc[:, None]) & (self.v <= vc[:, None])
            )
            if not cand.any():
                break
            with np.errstate(divide="ignore", invalid="ignore"):
                slope = np.where(cand, (vc[:, None] - self.v) / (wf - wc[:, None]), -1.0)
            nxt = slope.argmax(axis=1)
            has = cand[rows, nxt]
            eff = np.minimum(slope[rows, nxt], prev_eff)
            r = rows[has]
            seg_row.append(r)
            seg_level.append(np.full(r.size, level))
            seg_dw.append(self.w[r, nxt[r]] - wc[r])
            seg_eff.append(eff[r])
            prev_eff = np.where(has, eff, prev_eff)
            cur = np.where(has, nxt, cur)
            vertices.append(cur)
        self.vertices = np.stack(vertices, axis=1)
        self.seg_row = np.concatenate(seg_row) if seg_row else np.zeros(0, np.int64)
        self.seg_level = np.concatenate(seg_level) if seg_level else np.zeros(0, np.int64)
        self.seg_dw = np.concatenate(seg_dw) if seg_dw else np.zeros(0, np.int64)
        self.seg_eff = np.concatenate(seg_eff) if seg_eff else np.zeros(0)

    def greedy(self, budget: int) -> tuple[np.ndarray, float]:
        """Sorted-column choice of the hull greedy and its multiplier (0 if all segments fit)."""
        n_items = self.w.shape[0]
        # Segments were built level by level, rows ascending: a stable sort keeps that tie order.
        order = np.argsort(-self.seg_eff, kind="stable")
        base = int(self.w[:, 0].sum())
        cum = base + np.cumsum(self.seg_dw[order])
        p = int(np.searchsorted(cum, budget, side="right"))
        counts = np.bincount(self.seg_row[order[:p]], minlength=n_items)
        choice = self.vertices[np.arange(n_items), counts]
        lam = float(self.seg_eff[order[p]]) if p < order.size else 0.0
        return choice, lam

    def to_original(self, choice: np.ndarray) -> np.ndarray:
        return self.order[np.arange(choice.size), choice]


def solve_greedy(w: np.ndarray, v: np.ndarray, ok: np.ndarray, budget: int) -> np.ndarray:
    """Hull greedy (see module docstring); returns one original column index per item."""
    hull = _Hull(w, v, ok)
    return hull.to_original(hull.greedy(budget)[0])


def solve_exact(w: np.ndarray, v: np.ndarray, ok: np.ndarray, budget: int) -> np.ndarray:
    """Optimal choice per item: hull greedy, reduced-cost fixing, Pareto DP on the core."""
    hull = _Hull(w, v, ok)
    choice, lam = hull.greedy(budget)
    rows = np.arange(w.shape[0])
    slack = budget - int(hull.w[rows, choice].sum())
    gap = lam * slack
    if gap <= 0.0:
        return hull.to_original(choice)
    hw, hv, hok = hull.w, hull.v, hull.ok
    with np.errstate(invalid="ignore", over="ignore"):
        lagr = np.where(hok, hv + lam * hw.astype(np.float64), np.inf)
    m = lagr.min(axis=1)
    tol = 1e-12 * np.abs(np.where(hok, lagr, 0.0)).max(axis=1, keepdims=True)
    red = np.maximum(lagr - m[:, None], 0.0)
    # Phase 1: a better incumbent from the items whose next choice is cheapest in reduced cost.
    others = red.copy()
    others[rows, choice] = np.inf
    near = np.argsort(others.min(axis=1), kind="stable")[:_HEURISTIC_CORE]
    best = choice.copy()
    best, gap = _improve(best, near, hw, red, hok, budget, lam, gap, tol)
    # Phase 2: reduced-cost fixing with the improved gap, then the exact DP on what is left.
    free = hok & (red < gap * (1.0 + 1e-9) + tol)
    fixed = free.sum(axis=1) == 1
    best[fixed] = free[fixed].argmax(axis=1)
    best, _ = _improve(best, np.flatnonzero(~fixed), hw, red, hok, budget, lam, gap, tol)
    return hull.to_original(best)


def _improve(
    best: np.ndarray,
    items: np.ndarray,
    w: np.ndarray,
    red: np.ndarray,
    ok: np.ndarray,
    budget: int,
    lam: float,
    gap: float,
    tol: np.ndarray,
) -> tuple[np.ndarray, float]:
    """Re-optimise ``items`` (others stay as in ``best``) if that beats objective ``gap``."""
    rest = np.ones(best.size, dtype=bool)
    rest[items] = False
    cap = budget - int(w[rest, best[rest]].sum())
    free = ok[items] & (red[items] < gap * (1.0 + 1e-9) + tol[items])
    picked = _pareto_dp(w[items], red[items], free, cap, lam, gap * (1.0 + 1e-9))
    if picked is None:
        return best, gap
    out = best.copy()
    out[items] = picked
    rows = np.arange(out.size)
    new_gap = float(red[rows, out].sum()) + lam * (budget - int(w[rows, out].sum()))
    return out, new_gap


def _pareto_dp(
    w: np.ndarray, r: np.ndarray, free: np.ndarray, cap: int, lam: float, limit: float
) -> np.ndarray | None:
    """Best core choice with ``Σ r + λ·slack < limit``, or None if no state beats the limit."""
    n = w.shape[0]
    wmin = np.where(free, w, _BIG).min(axis=1)
    wmax = np.where(free, w, -1).max(axis=1)
    suf_min = np.concatenate([np.cumsum(wmin[::-1])[::-1], [0]])
    suf_max = np.concatenate([np.cumsum(wmax[::-1])[::-1], [0]])
    rem = np.array([cap], dtype=np.int64)  # capacity left, per state
    red = np.zeros(1)
    history: list[tuple[np.ndarray, np.ndarray]] = []
    for i in range(n):
        cols = np.flatnonzero(free[i])
        rem_new = (rem[:, None] - w[i, cols][None, :]).ravel()
        red_new = (red[:, None] + r[i, cols][None, :]).ravel()
        parent = np.repeat(np.arange(rem.size), cols.size)
        col = np.tile(cols, rem.size)
        short = np.maximum(rem_new - suf_max[i + 1], 0).astype(np.float64)
        keep = (rem_new >= suf_min[i + 1]) & (red_new + lam * short < limit)
        rem_new, red_new, parent, col = rem_new[keep], red_new[keep], parent[keep], col[keep]
        if rem_new.size == 0:
            return None
        key = red_new + lam * rem_new.astype(np.float64)
        order = np.lexsort((key, -rem_new))  # most capacity left first, then best key
        key = key[order]
        run_min = np.minimum.accumulate(key)
        pareto = np.ones(key.size, dtype=bool)
        pareto[1:] = key[1:] < run_min[:-1]
        sel = order[pareto]
        rem, red = rem_new[sel], red_new[sel]
        history.append((parent[sel], col[sel]))
    total = red + lam * rem.astype(np.float64)
    idx = int(np.argmin(total))
    if not total[idx] < limit / (1.0 + 1e-9) * (1.0 - 1e-9):
        return None
    out = np.empty(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        parent, col = history[i]
        out[i] = col[idx]
        idx = int(parent[idx])
    return out
