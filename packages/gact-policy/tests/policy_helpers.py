"""Shared helpers of the gact-policy tests: brute force and adversarial instance strategies."""

from __future__ import annotations

import itertools

import numpy as np
from gact_policy import FULL_PRECISION, storage_bits, variance_factor
from hypothesis import strategies as st

WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, FULL_PRECISION)


def scaled(c) -> np.ndarray:
    """Sensitivities in the units of ``Allocation.variance`` (largest finite one = 1)."""
    c = np.asarray(c, dtype=np.float64)
    finite = np.isfinite(c)
    top = c[finite].max() if finite.any() else 0.0
    if top == 0.0:
        return np.where(finite, 0.0, 1.0)
    return np.where(finite, np.where(finite, c, 0.0) / top, 2.0)


def brute_force(c, numel, budget, choices, overhead=0.0, full_bits=32) -> float | None:
    """Smallest ``Σ c S(b)`` over all allocations within ``budget`` bits (None: infeasible)."""
    n = len(c)
    full = np.broadcast_to(np.asarray(full_bits), (n,))
    ov = np.broadcast_to(np.asarray(overhead, dtype=np.float64), (n,))
    cost, value = [], []
    for i in range(n):
        bits = sorted({b if b < FULL_PRECISION else int(full[i]) for b in choices})
        cost.append(
            [storage_bits([numel[i]], [b], full_bits=full[i], overhead_bits=ov[i]) for b in bits]
        )
        value.append(float(np.asarray(c, dtype=np.float64)[i]) * variance_factor(bits))
    grid = np.array(list(itertools.product(*[range(len(k)) for k in cost])), dtype=np.int64)
    total_cost = sum(np.asarray(cost[i], dtype=np.int64)[grid[:, i]] for i in range(n))
    total_value = sum(np.asarray(value[i])[grid[:, i]] for i in range(n))
    fits = total_cost <= budget
    return float(np.min(total_value[fits])) if fits.any() else None


def _log_uniform(draw, n: int) -> list[int]:
    exps = draw(st.lists(st.floats(0.0, 6.0), min_size=n, max_size=n))
    return [int(10**e) for e in exps]


@st.composite
def adversarial_sizes(draw, n: int) -> list[int]:
    """Item sizes from the families that defeat naive dynamic programmes and sorts."""
    family = draw(
        st.sampled_from(
            ["log_uniform", "uniform", "huge_and_tiny", "equal", "powers_of_two", "gcd", "coprime"]
        )
    )
    if family == "log_uniform":
        return _log_uniform(draw, n)
    if family == "uniform":
        return draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
    if family == "huge_and_tiny":
        tiny = draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
        huge = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        return [t + (10**9 if h else 0) for t, h in zip(tiny, huge)]
    if family == "equal":
        return [draw(st.integers(1, 10**6))] * n
    if family == "powers_of_two":
        return [2**e for e in draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))]
    if family == "gcd":
        g = draw(st.sampled_from([7919 * 64, 2**20, 999_983]))
        return [g * k for k in draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))]
    primes = [p for p in range(100_003, 101_000, 2) if all(p % d for d in range(3, 318, 2))]
    return draw(st.lists(st.sampled_from(primes), min_size=n, max_size=n, unique=True))


@st.composite
def adversarial_sensitivities(draw, n: int) -> list[float]:
    """Heavy tails, ties, zeros and non-finite values."""
    family = draw(st.sampled_from(["spread", "ties", "zeros", "equal", "extreme"]))
    if family == "spread":
        return [10**e for e in draw(st.lists(st.floats(-8, 8), min_size=n, max_size=n))]
    if family == "ties":
        return draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=n, max_size=n))
    if family == "zeros":
        return draw(st.lists(st.sampled_from([0.0, 0.0, 1.0, 3.0]), min_size=n, max_size=n))
    if family == "equal":
        return [1.0] * n
    values = [0.0, 1e-300, 1.0, 1e300, 1e308, float("inf"), float("nan")]
    return draw(st.lists(st.sampled_from(values), min_size=n, max_size=n))
