"""Solvers for the multiple-choice knapsack behind :func:`gact_policy.allocate_bits`.

Problem: items ``l`` with choices ``j`` of integer cost ``w[l, j]`` (bits) and value ``v[l, j]``
(predicted variance); pick one allowed choice per item minimising ``Σ v`` subject to ``Σ w <= B``.

*Hull.* Per item, the lower convex hull of its points ``(w, v)`` starting at the lightest point;
its segments have non-increasing *efficiency* (variance removed per bit added). It is built for
all items at once: the points are sorted by cost (a no-op for the allocator's matrices) and every
point that is dominated (heavier, not lower) or lies above the chord of its neighbours is removed,
all items and all such points in one vectorised pass. Each removed point is provably not a hull
vertex (it lies above a chord of two points), and when a pass removes nothing the chain is convex,
so it is the hull. For the allocator's inputs (``S(b)`` is convex, so all quantised points are
already in convex position) one pass over adjacent differences settles almost every item; only
items whose full-precision point cuts off quantised points are iterated, on their own.

*Hull greedy.* Taking all segments of all items in order of decreasing efficiency while the
budget holds gives a solution ``x_G`` that minimises the Lagrangian ``Σ (v + λ w)`` at the
multiplier ``λ`` = efficiency of the first segment that did not fit (the *critical* segment). By
Everett's theorem ``x_G`` is optimal for the budget ``W(x_G)`` it uses, and the LP (convex-hull)
relaxation has value ``L(λ) = V(x_G) - λ·(B - W(x_G))``. Hence greedy is optimal whenever its
slack ``B - W(x_G)`` is zero (the budget lands on a hull breakpoint) or ``λ = 0``, and in general
``V(x_G) - OPT <= λ·slack``. The segments are not sorted: their efficiencies are bucketed by the
top bits of their IEEE-754 representation (monotone for non-negative floats), one weighted
``bincount`` locates the bucket holding the critical segment, and only that bucket is sorted
(by efficiency, then hull level, then item). The budget arithmetic is re-checked in exact
integers and falls back to a full sort if floating-point sums disagree, so the result is the
same as sorting all segments. Inputs are expected choice-major (Fortran order, as the allocator
builds them): reductions over an item's few choices then run along contiguous memory, which is
an order of magnitude faster in numpy; any layout gives the same result.

*Exact.* For any feasible ``x``: ``V(x) = L(λ) + Σ_l r[l, x_l] + λ·slack(x)`` with reduced costs
``r[l, j] = v + λ w - min_k (v + λ w)[l, k] >= 0``. A solution beats the incumbent ``x_G`` only
if ``Σ r + λ·slack < gap := λ·slack(x_G)``, so every choice with ``r >= gap`` is eliminated
(reduced-cost fixing). Items left with one choice are fixed; the few *core* items (slopes near
``λ``) are solved by a Pareto-list dynamic programme (Nemhauser-Ullmann) that keeps, after each
stage, the non-dominated partial states ``(weight, Σ r + λ·(B' - weight))`` and prunes states with
``Σ r >= gap``, states that cannot fit, and states that cannot fill the budget closely enough.
Identical core items (same costs, reduced costs and remaining choices) form one stage: a class of
``q`` items is a multiset of choices, enumerated as bounded counts ``n_j`` of the choices other
than the two with the smallest reduced cost (``Σ n_j r_j < gap`` bounds them) and a count ``k``
of the heavier of those two, the rest taking the lighter; the ``k`` compatible with each state's
capacity and bounds form an interval computed in closed form. This is the same problem (items
of a class are interchangeable), so the result stays exact, but ``10,000`` identical items tied
at the multiplier cost one stage instead of a quadratic number of states (when the bounded
counts would exceed a few thousand options the class is split back into single items). Stages
are ordered by decreasing weight range, which keeps the windows of states that can still fill
the budget narrow. All prunings are valid bounds, so the result is optimal (up to floating-point
rounding, relative ``1e-9`` of the gap). Its cost is that of the greedy plus the DP on the core.
"""

from __future__ import annotations

import numpy as np

__all__ = ["solve_exact", "solve_greedy"]

_BIG = np.iinfo(np.int64).max
_HEURISTIC_CORE = 12
_BUCKET_SHIFT = 45  # keep sign, exponent and 7 mantissa bits of an efficiency as its bucket
_MAX_CLASS_OPTIONS = 4096


class _Hull:
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
        """Sorted-column choice of the hull greedy and its multiplier (0 if all segments fit)."""
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


def solve_greedy(w: np.ndarray, v: np.ndarray, ok: np.ndarray, budget: int) -> np.ndarray:
    """Hull greedy (see module docstring); returns one original column index per item."""
    hull = _Hull(w, v, ok)
    return hull.to_original(hull.greedy(budget)[0])


def solve_exact(w: np.ndarray, v: np.ndarray, ok: np.ndarray, budget: int) -> np.ndarray:
    """Optimal choice per item: hull greedy, reduced-cost fixing, Pareto DP on the core."""
    hull = _Hull(w, v, ok)
    choice, lam = hull.greedy(budget)
    rows = np.arange(w.shape[0])
    hw, hv, hok = hull.w, hull.v, hull.ok
    slack = budget - int(hw[rows, choice].sum())
    gap = lam * slack
    if gap <= 0.0:
        return hull.to_original(choice)
    # Reductions over the few choices of every item run along the transposed (choice-major)
    # view: contiguous for the allocator's Fortran-order matrices, and many times faster than
    # numpy's reductions along a short inner axis. Large temporaries are updated in place.
    lagr = hw.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        lagr *= lam
        lagr += hv
    if hok.all():
        scale = lagr.T.max(axis=0)
    else:
        lagr[~hok] = np.inf
        scale = np.where(hok, lagr, 0.0).T.max(axis=0)
    tol = 1e-12 * scale[:, None]  # lagr >= 0: costs and values are non-negative
    red = lagr
    red -= lagr.T.min(axis=0)[:, None]  # reduced costs >= 0; inf where not allowed
    best = choice.copy()
    free = red < gap * (1.0 + 1e-9) + tol
    if np.count_nonzero(free.T.sum(axis=0, dtype=np.int32) > 1) > _HEURISTIC_CORE:
        # Phase 1: a better incumbent from the items whose next choice is cheapest in reduced
        # cost (the 12 smallest, ties to the lower index), to tighten the fixing below.
        at_choice = red[rows, choice]
        red[rows, choice] = np.inf
        nearest = red.T.min(axis=0)
        red[rows, choice] = at_choice
        kth = np.partition(nearest, _HEURISTIC_CORE - 1)[_HEURISTIC_CORE - 1]
        near = np.flatnonzero(nearest <= kth)
        near = near[np.argsort(nearest[near], kind="stable")[:_HEURISTIC_CORE]]
        best, gap = _improve(best, near, hw, red, hok, budget, lam, gap, tol)
        free = red < gap * (1.0 + 1e-9) + tol
    # Phase 2: reduced-cost fixing with the (improved) gap, then the exact DP on what is left.
    # An item with one choice left keeps it (its Lagrangian minimiser, reduced cost 0).
    free_t = free.T
    fixed = free_t.sum(axis=0, dtype=np.int32) == 1
    column = np.arange(free.shape[1], dtype=np.int32)[:, None]
    best[fixed] = (free_t * column).sum(axis=0, dtype=np.int32)[fixed]
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
    rows = np.arange(best.size)
    cap = budget - int(w[rows, best].sum()) + int(w[items, best[items]].sum())
    free = ok[items] & (red[items] < gap * (1.0 + 1e-9) + tol[items])
    picked = _pareto_dp(w[items], red[items], free, cap, lam, gap * (1.0 + 1e-9))
    if picked is None:
        return best, gap
    out = best.copy()
    out[items] = picked
    new_gap = float(red[rows, out].sum()) + lam * (budget - int(w[rows, out].sum()))
    return out, new_gap


class _Stage:
    """One DP stage: ``members`` (identical items) pick a multiset of their free choices.

    A single item (``counts`` None) has one option per free column ``cols[o]``. A class of
    ``q`` items has one option per row ``counts[o]``: that many items take the columns
    ``cols[2:]``, and of the ``rest[o]`` others ``k`` (chosen per state) take ``hi = cols[1]``
    and the rest ``lo = cols[0]`` (``lo`` lighter than ``hi``).
    """

    def __init__(
        self,
        members: np.ndarray,
        cols: np.ndarray,
        wj: np.ndarray,
        rj: np.ndarray,
        counts: np.ndarray | None = None,
    ) -> None:
        self.members, self.cols, self.counts = members, cols, counts
        q = members.size
        self.span = (q * int(wj.min()), q * int(wj.max()))
        if counts is None:
            self.d_w, self.d_r = wj, rj
            self.d, self.dr = 0, 0.0
            return
        two = min(1, cols.size - 1)
        self.rest = q - counts.sum(axis=1)
        self.d_w = counts @ wj[2:] + self.rest * wj[0]  # with k = 0
        self.d_r = counts @ rj[2:] + self.rest * rj[0]
        self.d, self.dr = int(wj[two] - wj[0]), float(rj[two] - rj[0])

    def assign(self, o: int, k: int) -> np.ndarray:
        if self.counts is None:
            return self.cols[o : o + 1]
        extra = np.repeat(self.cols[2:], self.counts[o])
        hi = np.full(k, self.cols[min(1, self.cols.size - 1)])
        lo = np.full(int(self.rest[o]) - k, self.cols[0])
        return np.concatenate([extra, hi, lo])


def _class_stage(
    members: np.ndarray, cols: np.ndarray, wj: np.ndarray, rj: np.ndarray, limit: float
) -> _Stage | None:
    """Stage for ``q >= 2`` identical items, or None if the bounded counts are too many."""
    q = members.size
    order = np.lexsort((wj, rj))  # smallest reduced cost first
    cols, wj, rj = cols[order], wj[order], rj[order]
    first = np.sort(np.unique(wj, return_index=True)[1])  # equal cost: smaller reduced cost
    cols, wj, rj = cols[first], wj[first], rj[first]
    if cols.size >= 2 and wj[1] < wj[0]:  # lo, hi: the lighter and heavier of the two best
        cols[:2], wj[:2], rj[:2] = cols[1::-1].copy(), wj[1::-1].copy(), rj[1::-1].copy()
    options: list[tuple[tuple[int, ...], int, float]] = [((), 0, 0.0)]
    for j in range(2, cols.size):
        grown = []
        for cnt, used, red in options:
            t = 0
            while used + t <= q and red + t * rj[j] < limit:
                grown.append(((*cnt, t), used + t, red + t * rj[j]))
                t += 1
                if len(grown) > _MAX_CLASS_OPTIONS:
                    return None
        options = grown
    counts = np.array([o[0] for o in options], dtype=np.int64).reshape(len(options), -1)
    return _Stage(members, cols, wj, rj, counts)


def _stages(w: np.ndarray, r: np.ndarray, free: np.ndarray, limit: float) -> list[_Stage]:
    """Group identical items into class stages; order by decreasing weight range."""
    key = np.concatenate([np.where(free, w, -1), np.where(free, r, -1.0).view(np.int64)], axis=1)
    groups: dict[bytes, list[int]] = {}
    if key.shape[0] > 256:
        _, inverse = np.unique(key, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        order = np.argsort(inverse, kind="stable")
        bounds = np.flatnonzero(np.diff(inverse[order])) + 1
        members_of = np.split(order, bounds)
    else:
        for i, row in enumerate(key):
            groups.setdefault(row.tobytes(), []).append(i)
        members_of = [np.array(m) for m in groups.values()]
    stages = []
    for members in members_of:
        cols = np.flatnonzero(free[members[0]])
        wj, rj = w[members[0], cols], r[members[0], cols]
        stage = _class_stage(members, cols, wj, rj, limit) if members.size > 1 else None
        if stage is None:
            stages.extend(_Stage(members[i : i + 1], cols, wj, rj) for i in range(members.size))
        else:
            stages.append(stage)
    stages.sort(key=lambda s: (s.span[0] - s.span[1], int(s.members[0])))
    return stages


def _pareto_dp(
    w: np.ndarray, r: np.ndarray, free: np.ndarray, cap: int, lam: float, limit: float
) -> np.ndarray | None:
    """Best core choice with ``Σ r + λ·slack < limit``, or None if no state beats the limit."""
    n = w.shape[0]
    stages = _stages(w, r, free, limit)
    smin = np.array([s.span[0] for s in stages] + [0], dtype=np.int64)
    smax = np.array([s.span[1] for s in stages] + [0], dtype=np.int64)
    suf_min = np.cumsum(smin[::-1])[::-1]
    suf_max = np.cumsum(smax[::-1])[::-1]
    rem = np.array([cap], dtype=np.int64)  # capacity left, per state
    red = np.zeros(1)
    history: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
    for i, st in enumerate(stages):
        lo_next, hi_next = suf_min[i + 1], suf_max[i + 1]
        n_opt = st.d_w.size
        if st.d <= 0:  # no k to choose: every (state, option) pair once
            rem_new = (rem[:, None] - st.d_w[None, :]).ravel()
            red_new = (red[:, None] + st.d_r[None, :]).ravel()
            parent = None
        else:
            rem_new, red_new, parent, opt, k = _class_pairs(
                st, rem, red, lo_next, hi_next, lam, limit
            )
        short = np.maximum(rem_new - hi_next, 0)
        idx = np.flatnonzero((rem_new >= lo_next) & (red_new + lam * short < limit))
        if idx.size == 0:
            return None
        rem_new, red_new = rem_new[idx], red_new[idx]
        key = red_new + lam * rem_new.astype(np.float64)
        order = np.lexsort((key, -rem_new))  # most capacity left first, then best key
        key = key[order]
        pareto = np.ones(key.size, dtype=bool)
        pareto[1:] = key[1:] < np.minimum.accumulate(key)[:-1]
        sel = order[pareto]
        rem, red = rem_new[sel], red_new[sel]
        sel = idx[sel]
        if parent is None:
            history.append((sel // n_opt, sel % n_opt, None))
        else:
            history.append((parent[sel], opt[sel], k[sel]))
    total_key = red + lam * rem.astype(np.float64)
    idx = int(np.argmin(total_key))
    if not total_key[idx] < limit / (1.0 + 1e-9) * (1.0 - 1e-9):
        return None
    out = np.empty(n, dtype=np.int64)
    for i in range(len(stages) - 1, -1, -1):
        parent, opt, k = history[i]
        out[stages[i].members] = stages[i].assign(int(opt[idx]), 0 if k is None else int(k[idx]))
        idx = int(parent[idx])
    return out


def _class_pairs(
    st: _Stage,
    rem: np.ndarray,
    red: np.ndarray,
    lo_next: int,
    hi_next: int,
    lam: float,
    limit: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidate states ``(rem, red, parent, option, k)`` of a class stage.

    ``k`` of the ``rest`` items take ``hi`` (cost ``+d``, reduced cost ``+dr`` each). Per
    (state, option) pair, ``k`` is bounded by the capacity, the shortfall bound and the
    reduced-cost limit (a superset, with a margin for rounding); the caller filters exactly.
    """
    n_opt = st.d_w.size
    base_rem = rem[:, None] - st.d_w[None, :]  # with k = 0
    base_red = red[:, None] + st.d_r[None, :]
    top = float(st.rest.max()) + 1.0
    khi = np.minimum((base_rem - lo_next) // st.d, st.rest[None, :])
    red_low = base_red + st.rest[None, :] * min(st.dr, 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        kmin = (base_rem - hi_next - (limit - red_low) / lam) / st.d - 1.0
        if st.dr > 0.0:
            kred = np.clip((limit - base_red) / st.dr + 1.0, -1.0, top)
            khi = np.minimum(khi, np.floor(kred).astype(np.int64))
        elif st.dr < 0.0:
            kmin = np.maximum(kmin, (limit - base_red) / st.dr - 1.0)
    klo = np.maximum(np.floor(np.clip(kmin, -1.0, top)).astype(np.int64), 0)
    cnt = np.maximum(khi - klo + 1, 0).ravel()
    total = int(cnt.sum())
    pair = np.repeat(np.arange(cnt.size), cnt)
    k = klo.ravel()[pair] + (np.arange(total) - (np.cumsum(cnt) - cnt)[pair])
    rem_new = base_rem.ravel()[pair] - k * st.d
    red_new = base_red.ravel()[pair] + k * st.dr
    return rem_new, red_new, pair // n_opt, pair % n_opt, k
