"""Pareto-list dynamic programme over the core items of the bounded search (private)."""

from __future__ import annotations

import numpy as np

__all__ = ["OutOfWork", "Work", "pareto_dp", "row_hash"]

_MAX_CLASS_OPTIONS = 4096
# Work units are DP states (~0.06 us each on a 2-core x86 machine, numpy 2.4); a stage's fixed
# cost (~25 numpy calls, ~22 us) and an enumerated class option (a Python loop, ~0.7 us) are
# charged in the same units, as measured there.
_STAGE_COST = 400
_OPTION_COST = 12
_HASH = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB], dtype=np.uint64)


class OutOfWork(Exception):
    """The search spent its work budget."""


class Work:
    """Work units left; :meth:`spend` raises :class:`OutOfWork` instead of overdrawing."""

    def __init__(self, limit: int | None) -> None:
        self.left = float("inf") if limit is None else float(limit)

    def spend(self, units: float) -> None:
        if units > self.left:
            raise OutOfWork
        self.left -= units


# NOTE [Class stages]
# Identical core items (same costs, reduced costs and remaining choices) form one stage: a class
# of ``q`` items is a multiset of choices, enumerated as bounded counts ``n_j`` of the choices
# other than the two with the smallest reduced cost (``Σ n_j r_j < gap`` bounds them) and a count
# ``k`` of the heavier of those two, the rest taking the lighter; the ``k`` compatible with each
# state's capacity and bounds form an interval computed in closed form. This is the same problem
# (items of a class are interchangeable), so the result stays exact, but 10,000 identical items
# tied at the multiplier cost one stage instead of a quadratic number of states (when the bounded
# counts would exceed ``_MAX_CLASS_OPTIONS`` the class is split back into single items). Stages
# are ordered by decreasing weight range, which keeps the windows of states that can still fill
# the budget narrow.


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
    members: np.ndarray,
    cols: np.ndarray,
    wj: np.ndarray,
    rj: np.ndarray,
    limit: float,
    work: Work,
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
        affordable = work.left / _OPTION_COST
        for cnt, used, red in options:
            t = 0
            while used + t <= q and red + t * rj[j] < limit:
                grown.append(((*cnt, t), used + t, red + t * rj[j]))
                t += 1
                if len(grown) > _MAX_CLASS_OPTIONS:
                    return None
                if len(grown) > affordable:
                    raise OutOfWork
        work.spend(_OPTION_COST * len(grown))
        options = grown
    counts = np.array([o[0] for o in options], dtype=np.int64).reshape(len(options), -1)
    return _Stage(members, cols, wj, rj, counts)


def row_hash(key: np.ndarray) -> np.ndarray:
    """A 64-bit hash per row of an int64 matrix (wrapping arithmetic)."""
    return _hash_columns([key[:, j] for j in range(key.shape[1])])


def _hash_columns(columns: list[np.ndarray]) -> np.ndarray:
    h = np.zeros(columns[0].size, dtype=np.uint64)
    for j, col in enumerate(columns):
        h ^= col.view(np.uint64)
        h *= _HASH[j % _HASH.size]
        h += np.uint64(j)
    return h


def _stages(
    w: np.ndarray, r: np.ndarray, free: np.ndarray, limit: float, work: Work
) -> list[_Stage]:
    """Group identical items into class stages; order by decreasing weight range.

    Items are grouped by a hash of their free choices' costs and reduced costs, verified
    against the group's first member (an item that differs, after a collision, gets a stage of
    its own: the DP does not need identical items grouped to be exact). Every stage is charged
    before it is built.
    """
    # Identical items share the cost of their first free choice: its distinct values are a
    # lower bound on the stages, charged before the grouping itself is paid for.
    lead = np.unique(w[np.arange(w.shape[0]), np.argmax(free, axis=1)]).size
    work.spend(_STAGE_COST * lead)
    columns = [np.where(free[:, j], w[:, j], -1) for j in range(w.shape[1])]
    columns += [np.where(free[:, j], r[:, j], -1.0).view(np.int64) for j in range(w.shape[1])]
    hashed = _hash_columns(columns)
    order = np.argsort(hashed)
    start = np.flatnonzero(np.r_[True, hashed[order[1:]] != hashed[order[:-1]]])
    count = np.diff(np.r_[start, order.size])
    work.spend(_STAGE_COST * max(start.size - lead, 0))
    multi = np.repeat(count > 1, count)
    members, first = order[multi], np.repeat(order[start], count)[multi]
    odd = np.zeros(order.size, dtype=bool)
    for col in columns:
        odd[multi] |= col[members] != col[first]
    work.spend(_STAGE_COST * np.count_nonzero(odd))
    groups = [order[a : a + q] for a, q in zip(start.tolist(), count.tolist())]
    groups = [g[~odd[a : a + g.size]] for g, a in zip(groups, start.tolist())]
    groups += [order[i : i + 1] for i in np.flatnonzero(odd)]
    stages = []
    for members in groups:
        if members.size == 0:
            continue
        cols = np.flatnonzero(free[members[0]])
        wj, rj = w[members[0], cols], r[members[0], cols]
        stage = _class_stage(members, cols, wj, rj, limit, work) if members.size > 1 else None
        if stage is None:
            work.spend(_STAGE_COST * (members.size - 1))
            stages.extend(_Stage(members[i : i + 1], cols, wj, rj) for i in range(members.size))
        else:
            stages.append(stage)
    stages.sort(key=lambda s: (s.span[0] - s.span[1], int(s.members.min())))
    return stages


def _pareto(rem: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Indices of the non-dominated states, by decreasing capacity left (then decreasing key).

    A state dominates another if it has at least as much capacity left and a key no larger
    (``key = Σ r + λ·capacity left``: every completion of the other fits and costs the same
    ``Σ r - λ·Δw``); one state is kept per capacity. Candidates arrive as runs sorted by
    decreasing capacity, which the stable sort (timsort) merges in near-linear time.
    """
    order = np.argsort(-rem, kind="stable")
    key_s = key[order]
    record = np.empty(key_s.size, dtype=bool)  # lower than every state with more capacity
    record[0] = True
    record[1:] = key_s[1:] < np.minimum.accumulate(key_s)[:-1]
    order = order[record]
    rem_s = rem[order]  # a record with equal capacity after it is dominated by that one
    last = np.ones(order.size, dtype=bool)
    last[:-1] = rem_s[:-1] != rem_s[1:]
    return order[last]


# NOTE [Pareto DP]
# Nemhauser-Ullmann over the core: a state is ``(capacity left, Σ r)`` after some stages. After
# each stage only non-dominated states are kept (more capacity left and a smaller
# ``Σ r + λ·capacity left``, see ``_pareto``), and a state is dropped when it cannot fit what the
# later stages need at least, or when even using all that they can take leaves a slack whose
# cost ``λ·slack`` with its ``Σ r`` reaches the incumbent's value (``limit``). The final state
# minimising ``Σ r + λ·capacity left`` is the best completion; the history of kept indices gives
# its choices back.
#
# Work: the stages are charged when they are built, their candidate states before they are
# materialised. A stage may spend the work left less one state's options per later stage
# (``allowance``), so a DP whose states all fit the budget runs exactly as without one; when a
# stage's candidates would exceed it, only the states with the smallest lower bound on their
# final value (``Σ r + λ·max(capacity left - what this and later stages can take, 0)``) are
# expanded (a beam). The DP then still returns its best completion, an incumbent at least as
# good as the one it was given, but no longer proves anything: ``exact`` is False.


def pareto_dp(
    w: np.ndarray,
    r: np.ndarray,
    free: np.ndarray,
    cap: int,
    lam: float,
    limit: float,
    work: Work,
) -> tuple[np.ndarray | None, bool]:
    """Best core choice with ``Σ r + λ·slack < limit`` (None if no state beats the limit) and
    whether that is exact (no state was left out for lack of work).

    Raises ``OutOfWork`` when the stages alone (or one state of a stage) exceed the budget.
    """
    stages = _stages(w, r, free, limit, work)
    spans = np.array([s.span for s in stages] + [(0, 0)], dtype=np.int64)
    suffix = np.cumsum(spans[::-1], axis=0)[::-1].tolist()  # bounds on what later stages use
    options = np.array([s.d_w.size for s in stages] + [0])
    reserve = np.cumsum(options[::-1])[::-1].tolist()  # one state per later stage
    rem = np.array([cap], dtype=np.int64)  # capacity left, per state
    red = np.zeros(1)
    exact = True
    history: list[tuple[np.ndarray, int, tuple[np.ndarray, ...] | None, np.ndarray | None]] = []
    for i, st in enumerate(stages):
        lo_next, hi_next = suffix[i + 1]
        allowance = work.left - reserve[i + 1]
        if st.d <= 0:  # no k to choose: every (option, state) pair once, option-major
            kept = None
            if rem.size * st.d_w.size > allowance:
                cost = np.full(rem.size, st.d_w.size)
                kept = _promising(rem, red, suffix[i][1], lam, cost, allowance)
                rem, red = rem[kept], red[kept]
            work.spend(rem.size * st.d_w.size)
            rem_new = (rem[None, :] - st.d_w[:, None]).ravel()
            red_new = (red[None, :] + st.d_r[:, None]).ravel()
            origin = None
        else:
            rem_new, red_new, kept, *origin = _class_pairs(
                st, rem, red, (lo_next, hi_next, suffix[i][1]), lam, limit, work, allowance
            )
        exact &= kept is None
        n_states = rem.size if kept is None else kept.size
        short = np.maximum(rem_new - hi_next, 0)
        idx = np.flatnonzero((rem_new >= lo_next) & (red_new + lam * short < limit))
        if idx.size == 0:
            return None, exact
        rem_new, red_new = rem_new[idx], red_new[idx]
        sel = _pareto(rem_new, red_new + lam * rem_new.astype(np.float64))
        rem, red = rem_new[sel], red_new[sel]
        history.append((idx[sel], n_states, None if origin is None else tuple(origin), kept))
    total_key = red + lam * rem.astype(np.float64)
    state = int(np.argmin(total_key))
    if not total_key[state] < limit / (1.0 + 1e-9) * (1.0 - 1e-9):
        return None, exact
    out = np.empty(w.shape[0], dtype=np.int64)
    for st, (cand, n_states, origin, kept) in zip(stages[::-1], history[::-1]):
        c = int(cand[state])
        if origin is None:
            state, opt, k = c % n_states, c // n_states, 0
        else:
            state, opt, k = (int(a[c]) for a in origin)
        if kept is not None:
            state = int(kept[state])
        out[st.members] = st.assign(opt, k)
    return out, exact


def _promising(
    rem: np.ndarray, red: np.ndarray, reach: int, lam: float, cost: np.ndarray, allowance: float
) -> np.ndarray:
    """Indices (ascending) of the states with the smallest lower bound on their final value
    whose expansion ``cost`` fits ``allowance`` (at least one state)."""
    bound = red + lam * np.maximum(rem - reach, 0).astype(np.float64)
    order = np.argsort(bound, kind="stable")
    take = max(int(np.searchsorted(np.cumsum(cost[order]), allowance, side="right")), 1)
    return np.sort(order[:take])


def _class_pairs(
    st: _Stage,
    rem: np.ndarray,
    red: np.ndarray,
    window: tuple[int, int, int],
    lam: float,
    limit: float,
    work: Work,
    allowance: float,
) -> tuple[np.ndarray, ...]:
    """Candidate states ``(rem, red, kept, parent, option, k)`` of a class stage.

    ``k`` of the ``rest`` items take ``hi`` (cost ``+d``, reduced cost ``+dr`` each). Per
    (state, option) pair, ``k`` is bounded by the capacity, the shortfall bound and the
    reduced-cost limit (a superset, with a margin for rounding); the caller filters exactly.
    ``window`` is what the later stages need at least and can take at most, and what this and
    the later stages can take; ``kept`` the states expanded when not all fit ``allowance``.
    """
    lo_next, hi_next, reach = window
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
    cnt = np.maximum(khi - klo + 1, 0)
    kept = None
    if cnt.sum() > allowance:
        kept = _promising(rem, red, reach, lam, cnt.sum(axis=1), allowance)
        base_rem, base_red, klo, cnt = base_rem[kept], base_red[kept], klo[kept], cnt[kept]
    cnt = cnt.ravel()
    total = int(cnt.sum())
    work.spend(total)
    pair = np.repeat(np.arange(cnt.size), cnt)
    k = klo.ravel()[pair] + (np.arange(total) - (np.cumsum(cnt) - cnt)[pair])
    rem_new = base_rem.ravel()[pair] - k * st.d
    red_new = base_red.ravel()[pair] + k * st.dr
    return rem_new, red_new, kept, pair // n_opt, pair % n_opt, k
