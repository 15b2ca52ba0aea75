"""Allocator: brute-force optimality, adversarial properties, edge cases and determinism."""

import dataclasses

import numpy as np
import pytest
from gact_policy import (
    Allocation,
    allocate,
    allocate_bits,
    min_storage_bits,
    predicted_variance,
    storage_bits,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st
from policy_helpers import (
    WIDTHS,
    adversarial_sensitivities,
    adversarial_sizes,
    brute_force,
    scaled,
)

TOL = 1e-9  # relative rounding tolerance of the exact search

sens = st.one_of(st.just(0.0), st.floats(1e-6, 1e6), st.sampled_from([1.0, 2.0]))
overheads = st.sampled_from([0.0, 0.25, 0.5, 1.3])
instance = st.integers(1, 5).flatmap(
    lambda k: st.tuples(
        st.lists(sens, min_size=k, max_size=k),
        st.lists(st.integers(0, 64), min_size=k, max_size=k),
        st.lists(st.sampled_from(WIDTHS), min_size=1, max_size=5, unique=True),
        st.one_of(overheads, st.lists(overheads, min_size=k, max_size=k)),
        st.lists(st.sampled_from([16, 32]), min_size=k, max_size=k),
        st.floats(0.0, 34.0),
    )
)


def check_bound(a: Allocation, best: float) -> None:
    """``a`` is feasible-looking and its reported gap bounds its true distance to ``best``."""
    assert a.storage_bits <= a.budget_bits
    assert a.lower_bound <= best * (1 + TOL) + 1e-300
    assert a.variance - best <= a.gap + TOL * best + 1e-300
    if a.optimal:
        assert a.gap == 0.0
        assert a.variance <= best * (1 + TOL) + 1e-300


@settings(max_examples=300, deadline=None)
@given(instance, st.sampled_from([None, 0, 400]))
def test_small_instances_match_brute_force(inst, max_states) -> None:
    c, n, choices, overhead, full, avg = inst
    budget = np.floor(avg * sum(n) + 1e-6)
    kw = dict(choices=choices, overhead_bits=overhead, full_bits=full)
    best = brute_force(scaled(c), n, budget, choices, overhead, full)
    if best is None:
        with pytest.raises(ValueError, match="minimum achievable average"):
            allocate(c, n, avg, **kw)
        return
    greedy = allocate(c, n, avg, method="greedy", **kw)
    exact = allocate(c, n, avg, max_states=max_states, **kw)
    for a in (greedy, exact):
        check_bound(a, best)
        assert a.storage_bits == storage_bits(n, a.bits, full_bits=full, overhead_bits=overhead)
        assert set(a.bits.tolist()) <= {b for b in choices if b < 16} | set(full)
        assert a.variance == pytest.approx(predicted_variance(scaled(c), a.bits), rel=1e-12)
    assert exact.variance <= greedy.variance * (1 + 1e-12) + 1e-300
    if max_states is None:
        assert exact.optimal
    if exact.optimal:
        assert exact.variance == pytest.approx(best, rel=TOL, abs=1e-300)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda k: st.tuples(
            adversarial_sensitivities(k), adversarial_sizes(k), st.floats(0.0, 8.0), st.data()
        )
    )
)
def test_adversarial_sizes_against_brute_force(inst) -> None:  # fmt: skip
    c, n, extra, data = inst
    k = len(c)
    overhead = data.draw(st.lists(st.sampled_from([0.25, 1.25, 2.25]), min_size=k, max_size=k))
    least = min_storage_bits(n, overhead_bits=overhead)
    budget_bytes = -(-least // 8) + int(extra * sum(n) / 8)
    best = brute_force(scaled(c), n, 8 * budget_bytes, WIDTHS, overhead)
    results = [
        allocate(c, n, None, budget_bytes=budget_bytes, overhead_bits=overhead, **kw)
        for kw in ({"method": "greedy"}, {"max_states": 0}, {})
    ]
    for a in results:
        check_bound(a, best)
    greedy, searched = results[0], results[1:]
    for a in searched:
        assert a.variance <= greedy.variance * (1 + 1e-12) + 1e-300
    if k <= 4:  # 2·9^4 states and 4 stages fit the default budget: always proven
        assert results[2].optimal


@settings(max_examples=60, deadline=None)
@given(
    st.integers(7, 60).flatmap(
        lambda k: st.tuples(adversarial_sensitivities(k), adversarial_sizes(k), st.floats(0.0, 8.0))
    )
)
def test_adversarial_sizes_bounded_search(inst) -> None:  # fmt: skip
    c, n, extra = inst
    budget_bytes = -(-min_storage_bits(n, overhead_bits=0.25) // 8) + int(extra * sum(n) / 8)
    kw = {"budget_bytes": budget_bytes, "overhead_bits": 0.25}
    greedy = allocate(c, n, None, method="greedy", **kw)
    results = [allocate(c, n, None, max_states=m, **kw) for m in (0, 2_000, "auto")]
    if len(c) <= 16:  # the unlimited search as the reference optimum
        best = allocate(c, n, None, max_states=None, **kw)
        assert best.optimal
        for a in (greedy, *results):
            check_bound(a, best.variance)
    for a in results:
        assert a.storage_bits <= a.budget_bits
        assert a.variance <= greedy.variance * (1 + 1e-12) + 1e-300
        assert a.lower_bound <= a.variance
        # Both bounds hold for the same optimum, so neither exceeds the other's variance.
        assert a.lower_bound <= greedy.variance * (1 + TOL) + 1e-300
        assert greedy.lower_bound <= a.variance * (1 + TOL) + 1e-300


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(0.0, 1e3), min_size=2, max_size=40),
    st.integers(1, 1000),
    st.floats(2.0, 12.0),
    st.sampled_from(["exact", "greedy"]),
)
def test_monotone_for_equal_sizes(c, size, avg, method) -> None:
    bits = allocate_bits(c, [size] * len(c), avg, method=method, overhead_bits=0.25)
    order = np.argsort(c, kind="stable")
    cs, bs = np.asarray(c)[order], bits[order]
    for i in range(len(c)):
        for j in range(len(c)):
            if cs[i] > cs[j]:
                assert bs[i] >= bs[j]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 30),
    st.integers(1, 500),
    st.floats(1.0, 9.0),
    st.sampled_from(["exact", "greedy"]),
)
@example(24, 1, 9.0, "exact")  # 23 items at 8 bits and one kept at 32: one hull step
def test_equal_items_get_uniform_bits(count, size, avg, method) -> None:
    bits = allocate_bits([3.0] * count, [size] * count, avg, method=method)
    assert np.all(np.diff(bits) <= 0)  # lower index never narrower
    hull = [1, 2, 3, 4, 5, 6, 7, 8, 32]  # default widths: all on the hull
    assert hull.index(bits.max()) - hull.index(bits.min()) <= 1  # at most one hull step apart
    uniform = int(np.floor(avg + 1e-9))
    assert bits.min() >= min(uniform, 8)


def test_uniform_when_affordable_exactly() -> None:
    for b in (2, 4, 8):
        for method in ("exact", "greedy"):
            bits = allocate_bits([1.0] * 7, [256] * 7, b + 0.25, overhead_bits=0.25, method=method)
            assert bits.tolist() == [b] * 7


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(0.0, 1e4), min_size=1, max_size=12),
    st.data(),
)
def test_bounds_and_pins_respected(c, data) -> None:
    k = len(c)
    n = data.draw(st.lists(st.integers(1, 300), min_size=k, max_size=k))
    lower = np.array(data.draw(st.lists(st.integers(1, 4), min_size=k, max_size=k)))
    upper = lower + np.array(data.draw(st.lists(st.integers(0, 30), min_size=k, max_size=k)))
    pinned = np.array(data.draw(st.lists(st.sampled_from([0, 0, 2, 32]), min_size=k, max_size=k)))
    bits = allocate_bits(c, n, 40.0, lower=lower, upper=upper, pinned=pinned)
    free = pinned == 0
    assert np.all(bits[free] >= lower[free])
    assert np.all(bits[free] <= upper[free])
    assert np.array_equal(bits[~free], pinned[~free])


def test_deterministic_and_ties() -> None:
    rng = np.random.default_rng(1)
    c = rng.choice([0.5, 1.0, 2.0], size=500)
    n = rng.choice([256, 1024], size=500)
    first = allocate_bits(c, n, 3.3, overhead_bits=0.25)
    for _ in range(3):
        assert np.array_equal(first, allocate_bits(c, n, 3.3, overhead_bits=0.25))


def test_exact_beats_or_matches_greedy_large() -> None:
    rng = np.random.default_rng(2)
    c = rng.lognormal(sigma=2, size=2000)
    n = rng.integers(1000, 10**6, size=2000)
    exact = allocate_bits(c, n, 3.0, overhead_bits=0.25)
    greedy = allocate_bits(c, n, 3.0, overhead_bits=0.25, method="greedy")
    budget = np.floor(3.0 * n.sum())
    for bits in (exact, greedy):
        assert storage_bits(n, bits, overhead_bits=0.25) <= budget
    assert predicted_variance(c, exact) <= predicted_variance(c, greedy) * (1 + 1e-12)


def test_many_identical_items_tied_at_the_multiplier() -> None:
    # 10,000 identical items and a budget between the 4- and 5-bit breakpoints (plus less than
    # one step): every item ties at the multiplier. The exact DP merges them into one class;
    # item by item it took seconds (a quadratic number of states).
    n, size = 10_000, 1000
    budget_bytes = (4500 * n + 500) // 8
    for method in ("exact", "greedy"):
        bits = allocate_bits([1.0] * n, [size] * n, None, budget_bytes=budget_bytes, method=method)
        assert storage_bits([size] * n, bits) <= 8 * budget_bytes
        assert np.bincount(bits, minlength=6)[4:].tolist() == [n // 2, n // 2]
        assert np.all(np.diff(bits) <= 0)  # the lowest-indexed items get the extra bit


def test_identical_classes_with_odd_items() -> None:
    # Two large classes tied near the multiplier plus a few odd items that can fill the slack.
    c = np.r_[np.full(4000, 1.0), np.full(3000, 3.0), [0.7, 5.0, 2.0]]
    n = np.r_[np.full(4000, 1000), np.full(3000, 1500), [333, 777, 1234]]
    budget = np.floor(4.3 * n.sum())
    exact = allocate_bits(c, n, 4.3, overhead_bits=0.25)
    greedy = allocate_bits(c, n, 4.3, overhead_bits=0.25, method="greedy")
    for bits in (exact, greedy):
        assert storage_bits(n, bits, overhead_bits=0.25) <= budget
    assert predicted_variance(c, exact) <= predicted_variance(c, greedy) * (1 + 1e-12)


def test_special_sensitivities() -> None:
    c = [np.nan, np.inf, 1e300, 0.0, 1e-300]
    bits = allocate_bits(c, [100] * 5, 5.0)
    assert bits[0] >= bits[2] and bits[1] >= bits[2] and bits[2] >= bits[4] >= bits[3]
    with pytest.raises(ValueError, match="non-negative"):
        allocate_bits([1.0, -1.0], [10, 10], 4.0)


def test_insensitive_items_take_their_cheapest_width() -> None:
    """A zero sensitivity adds no variance at any width, so the budget left over is not spent
    on it (a CiteSeer GCN at L2 kept a 3 MB tensor of sensitivity 0, saved only for its shape,
    at full precision): it takes its smallest allowed width, a pin still wins."""
    c, n = np.array([0.0, 1.0, 0.0, 0.0]), np.full(4, 1000)
    bits = allocate_bits(c, n, 20.0, lower=[2, 1, 1, 1], pinned=[0, 0, 4, 0])
    assert bits.tolist() == [2, 32, 4, 1]
    for method in ("exact", "greedy"):
        a = allocate(c, n, 20.0, method=method)
        assert a.bits.tolist() == [1, 32, 1, 1] and a.variance == 0.0 and a.optimal
        assert a.storage_bits == 3 * 1000 + 32 * 1000


def test_zero_sizes_and_full_precision_reporting() -> None:
    bits = allocate_bits([1.0, 1.0, 0.0], [0, 10, 0], 4.0, full_bits=[16, 32, 32])
    assert bits[0] == 16  # costs nothing: kept
    assert allocate_bits([1.0], [10], 32.0).tolist() == [32]
    assert allocate_bits([1.0], [10], 16.0, full_bits=16).tolist() == [16]
    assert allocate_bits([], [], 4.0).size == 0


def test_budget_bytes_and_overhead() -> None:
    n = [256] * 4
    bits = allocate_bits([1.0] * 4, n, None, budget_bytes=4 * 256 * 4.25 / 8, overhead_bits=0.25)
    assert bits.tolist() == [4] * 4
    # Without the overhead the same budget would buy more bits than are really stored.
    assert allocate_bits([1.0] * 4, n, 4.25).tolist() == [5, 4, 4, 4]


def test_errors() -> None:
    with pytest.raises(ValueError, match="minimum achievable average"):
        allocate_bits([1.0], [100], 0.5)
    with pytest.raises(ValueError, match="exactly one"):
        allocate_bits([1.0], [100], 4.0, budget_bytes=100)
    with pytest.raises(ValueError, match="method"):
        allocate_bits([1.0], [100], 4.0, method="lp")
    with pytest.raises(ValueError, match="no allowed width"):
        allocate_bits([1.0], [100], 4.0, lower=9, upper=12)
    with pytest.raises(ValueError, match="full_bits"):
        allocate_bits([1.0], [100], 4.0, full_bits=8)
    with pytest.raises(ValueError, match="one entry per item"):
        allocate_bits([1.0, 2.0], [100, 1, 3], 4.0)


def test_per_item_overhead_costs() -> None:
    # A quantised item costs numel·b + ceil(numel·overhead_l), a full-precision one
    # numel·full_bits, whatever its overhead (e.g. 1-2 bits of exact ReLU masks per element).
    n, ov, full = [1000, 1000, 333], [0.25, 2.25, 1.0 / 3.0], [32, 16, 32]
    assert storage_bits(n, [4, 4, 32], full_bits=full, overhead_bits=ov) == 4250 + 6250 + 10656
    assert storage_bits(n, [2, 16, 3], full_bits=full, overhead_bits=ov) == 2250 + 16000 + 1110
    # Equal sensitivities: the item with the dearer metadata gets the fewer bits.
    bits = allocate_bits(
        [1.0, 1.0], [1000, 1000], None, budget_bytes=1125, overhead_bits=[0.0, 2.0]
    )
    assert bits.tolist() == [4, 3]
    a = allocate([1.0, 3.0, 2.0], n, 5.0, full_bits=full, overhead_bits=ov)
    assert a.storage_bits == storage_bits(n, a.bits, full_bits=full, overhead_bits=ov)
    assert a.storage_bits <= a.budget_bits == np.floor(5.0 * sum(n))


def test_allocation_result() -> None:
    rng = np.random.default_rng(0)
    c, n = rng.lognormal(size=300), rng.integers(1, 10**5, size=300)
    a = allocate(c, n, 3.0, overhead_bits=0.25)
    bits = allocate_bits(c, n, 3.0, overhead_bits=0.25)
    assert np.array_equal(a.bits, bits) and bits.flags.writeable  # the caller's to modify
    assert a.bits.dtype == np.int64 and not a.bits.flags.writeable
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.optimal = True
    assert 0.0 <= a.lower_bound <= a.variance
    assert a.gap == a.variance - a.lower_bound and a.relative_gap == a.gap / a.variance
    assert a.variance == pytest.approx(predicted_variance(c / c.max(), a.bits), rel=1e-12)
    if a.optimal:
        assert a.gap == 0.0


def test_min_storage_bits_is_the_smallest_feasible_budget() -> None:
    n, ov = [100, 200, 300, 400], [0.5, 0.0, 1.0, 0.25]
    kw = dict(overhead_bits=ov, lower=[1, 2, 1, 1], pinned=[0, 0, 32, 0], choices=[2, 4, 16])
    least = min_storage_bits(n, **kw)
    assert least == 100 * 2.5 + 200 * 2 + 300 * 32 + 400 * 2.25
    a = allocate([1.0] * 4, n, least / sum(n), **kw)
    assert a.bits.tolist() == [2, 2, 32, 2] and a.storage_bits == least
    with pytest.raises(ValueError, match="minimum achievable average"):
        allocate([1.0] * 4, n, (least - 1) / sum(n), **kw)


def test_distinct_sizes_stay_bounded() -> None:
    # 3,000 items of distinct sizes ran out of memory (> 6 GB) after minutes in the unbounded
    # exact search; the bounded one returns a feasible allocation no worse than the greedy.
    rng = np.random.default_rng(0)
    n = np.exp(rng.uniform(np.log(1e3), np.log(1e6), 3000)).astype(np.int64)
    c = rng.lognormal(0.0, 2.0, 3000)
    a = allocate(c, n, 3.0)
    greedy = allocate(c, n, 3.0, method="greedy")
    assert a.storage_bits <= a.budget_bits
    assert a.variance <= greedy.variance
    assert a.relative_gap < 1e-3
