"""Framework-agnostic estimation of per-item sensitivities ``c_l`` by gradient probes.

The caller supplies ``grad(config) -> 1-D array``: one gradient evaluation (e.g. forward and
backward on a fixed sub-batch) with item ``l`` quantised to ``config.bits[l]`` using random seed
``config.seeds[l]``. :func:`probe_sensitivity` is the reference estimator (GACT Algorithm 1,
``1 + L`` evaluations), :func:`pairwise_sensitivity` the cheap one (``1 + K`` evaluations with
``K ≈ sqrt(2L)``). Non-finite or huge estimates are replaced by ``SENSITIVITY_CAP``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from numpy.typing import ArrayLike

from ._checks import integer_array, integer_scalar, real_scalar
from .variance import FULL_PRECISION, variance_factor

__all__ = [
    "SENSITIVITY_CAP",
    "GradFn",
    "ProbeConfig",
    "SensitivityEstimate",
    "min_pair_probes",
    "pairwise_sensitivity",
    "probe_sensitivity",
]

SENSITIVITY_CAP: float = 1e10
"""Value substituted for non-finite or larger sensitivity estimates (as the public GACT code)."""

# NOTE [Sensitivity estimators]
# Under the linearised model ``g = g* + Σ_l J_l ε_l`` with independent zero-mean rounding noise,
# ``E‖J_l ε_l‖² = c_l S(b_l)`` (NOTE [Variance model]).
#
# Reference (GACT Algorithm 1): a base run ``g0`` and, per item, a run with only that item
# re-seeded: ``E‖g0 - g_l‖² = 2 c_l S(b_l)``, so ``c_l = ‖g0 - g_l‖² / (2 S(b_l))``; ``1 + L``
# evaluations. ``robust=True`` is the public code's variant (three runs per item: 1 bit with two
# seeds ``a, b`` and ``high_bits`` with a third):
# ``c = max(d_ab / (2 S(1)), d_ac / (S(1) + S(high)), d_bc / (S(1) + S(high)))``, each term an
# unbiased estimate of ``c`` (the public ``max(d_ab, 2 max(d_ac, d_bc)) / (2 S(1))`` up to the
# factor ``1 + S(high)/S(1)``); ``3L`` evaluations, biased upwards on purpose.
#
# Pairwise (cheap): ``K`` probes, each re-seeding a set of items with fresh seeds; every item is
# re-seeded in exactly two probes ``{j, k}`` and no two items share a pair. With
# ``e_k = g0 - g_k``, ``E<e_j, e_k> = Σ_{l in S_j ∩ S_k} E‖J_l ε_l‖² = c_l S(b_l)`` (the fresh
# draws are independent of each other and of the base draw), so ``c_l = <e_j, e_k> / S(b_l)`` is
# unbiased, needs only ``1 + K`` evaluations with ``K(K-1)/2 >= L`` (``K ≈ sqrt(2L)``), and its
# error falls roughly like ``1/K`` because each probe then re-seeds about ``2L/K`` items whose
# cross terms are the noise. Its standard error is estimated from the same probes: the inner
# product is a sum over coordinates of ``e_j[i] e_k[i]``, and treating those terms as independent
# and zero-mean gives ``Var <e_j, e_k> ≈ Σ_i e_j[i]^2 e_k[i]^2`` (a plug-in, conservative because
# it also counts the signal's own spread; coordinates of a CountSketch are close to independent).


# NOTE [Floored estimates]
# With the few probes an adaptation can afford (about sqrt(2L)), a pairwise estimate is noisy:
# a negative inner product is clipped to 0, and on the GAT example a near-zero estimate of an
# important tensor sent it to 1 bit. An estimate below its own standard error cannot be told
# from noise, so allocations use ``max(estimate, stderr)``: an uncertain item is treated as
# mattering as much as the noise allows. On the synthetic model (30 items, log-normal
# sensitivities, the minimum probe count) 17% of raw estimates fall below a tenth of the true
# sensitivity and none of the floored ones do (test_floored_estimates_rarely_underestimate). An
# item whose probe differences are all exactly 0 keeps 0: its values do not reach the gradient.


@dataclass(frozen=True)
class SensitivityEstimate:
    """Sensitivity estimates and their standard errors (float64 arrays of the same length).

    Args:
        value: the estimates ``c_l`` (``>= 0``, capped).
        stderr: one standard error of each estimate, in the same unit.
    """

    value: np.ndarray
    stderr: np.ndarray

    def floored(self) -> np.ndarray:
        """Each estimate raised to at least its own standard error (see NOTE [Floored
        estimates]).

        Example:
            >>> SensitivityEstimate(np.array([0.0, 2.0]), np.array([0.5, 0.5])).floored()
            array([0.5, 2. ])
        """
        return np.maximum(self.value, self.stderr)


@dataclass(frozen=True)
class ProbeConfig:
    """Bit width and random seed per item for one gradient evaluation.

    Args:
        bits: integer widths, one per item (``>= 1``; ``>= FULL_PRECISION`` = unquantised).
        seeds: uint64 seeds, one per item.

    Example:
        >>> cfg = ProbeConfig(np.array([2, 4]), np.array([7, 8], dtype=np.uint64))
        >>> cfg.reseeded([1], [9]).seeds.tolist()
        [7, 9]
    """

    bits: np.ndarray
    seeds: np.ndarray

    def __post_init__(self) -> None:
        bits = np.array(self.bits)
        seeds = np.array(self.seeds)
        if bits.ndim != 1 or seeds.shape != bits.shape:
            raise ValueError("bits and seeds must be 1-D arrays of the same length")
        if bits.dtype.kind == "b":
            raise TypeError("bits must be integer widths, not booleans")
        if bits.size and (bits.dtype.kind not in "iu" or bits.min() < 1):
            raise ValueError("bits must be integers >= 1")
        if seeds.size and seeds.dtype != np.uint64:
            raise ValueError(f"seeds must have dtype uint64, got {seeds.dtype}")
        bits = bits.astype(np.int64)
        seeds = seeds.astype(np.uint64)
        bits.flags.writeable = False
        seeds.flags.writeable = False
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "seeds", seeds)

    def reseeded(self, items: ArrayLike, seeds: ArrayLike) -> ProbeConfig:
        """Copy with ``seeds[items]`` replaced."""
        new = self.seeds.copy()
        new[np.asarray(items, dtype=np.int64)] = np.asarray(seeds, dtype=np.uint64)
        return ProbeConfig(self.bits, new)

    def with_bits(self, items: ArrayLike, bits: ArrayLike) -> ProbeConfig:
        """Copy with ``bits[items]`` replaced."""
        new = self.bits.copy()
        new[np.asarray(items, dtype=np.int64)] = bits
        return ProbeConfig(new, self.seeds)


GradFn = Callable[[ProbeConfig], np.ndarray]
"""A gradient evaluation: config in, 1-D float array out (same length every call)."""


def _seeds(seed: int, count: int) -> np.ndarray:
    """``count`` distinct uint64 seeds derived from ``seed``."""
    out = np.random.default_rng(seed).integers(0, 2**63, size=count, dtype=np.uint64)
    if np.unique(out).size != count:  # astronomically unlikely; fall back to a counter
        out = np.arange(count, dtype=np.uint64) + np.uint64(seed % 2**32) * np.uint64(count)
    return out


def _probe_bits(bits: ArrayLike) -> np.ndarray:
    b = integer_array(bits, "bits")
    if b.size == 0:
        raise ValueError("bits must be non-empty, one probe width per item")
    if b.min() < 1 or b.max() >= FULL_PRECISION:
        raise ValueError(f"probe widths (bits) must be quantised: in [1, {FULL_PRECISION - 1}]")
    return b


def _check_options(seed: Any, cap: Any) -> tuple[int, float]:
    root = integer_scalar(seed, "seed")
    if root < 0:
        raise ValueError(f"seed must be >= 0, got {root}")
    limit = real_scalar(cap, "cap")
    if not (math.isfinite(limit) and limit > 0.0):
        raise ValueError(f"cap must be finite and > 0, got {cap}")
    return root, limit


def _cap(c: np.ndarray, cap: float) -> np.ndarray:
    return np.where(np.isfinite(c) & (c <= cap), np.maximum(c, 0.0), cap)


class _Gradients:
    """Calls ``grad`` and checks that every gradient has the length of the first."""

    def __init__(self, grad: GradFn) -> None:
        self.grad, self.size = grad, -1

    def __call__(self, cfg: ProbeConfig) -> np.ndarray:
        g = np.asarray(self.grad(cfg), dtype=np.float64).reshape(-1)
        if self.size < 0:
            self.size = g.size
        elif g.size != self.size:
            raise ValueError(
                f"grad returned a gradient of length {g.size} after one of length {self.size}: "
                "every evaluation must return the same parameters"
            )
        return g


def probe_sensitivity(
    grad: GradFn,
    bits: ArrayLike,
    *,
    seed: int = 0,
    robust: bool = False,
    high_bits: int = 8,
    cap: float = SENSITIVITY_CAP,
) -> np.ndarray:
    """Reference per-item estimator (``1 + L`` evaluations, or ``3L`` with ``robust``).

    Args:
        grad: gradient callable, see :data:`GradFn`.
        bits: probe width per item (quantised; ignored per item by ``robust``, which probes at
            1 bit and ``high_bits``).
        seed: root seed of all probe seeds (``>= 0``).
        robust: use the public code's three-run max estimator (NOTE [Sensitivity estimators]).
        high_bits: the high width of the robust variant.
        cap: replacement for non-finite estimates and upper bound (finite, ``> 0``).

    Returns:
        float64 array of ``c_l``.

    Raises:
        TypeError: on non-numeric arguments.
        ValueError: on invalid widths or options, or if ``grad`` changes its output length.

    Example:
        >>> g = lambda cfg: np.random.default_rng(int(cfg.seeds[0])).normal(size=4000) / 3
        >>> float(np.round(probe_sensitivity(g, [2])[0], -2))  # c = 4000 / 9 / S(2)
        4000.0
    """
    b = _probe_bits(bits)
    seed, cap = _check_options(seed, cap)
    high = integer_scalar(high_bits, "high_bits")
    if not 1 <= high < FULL_PRECISION:
        raise ValueError(f"high_bits must be a quantised width in [1, {FULL_PRECISION - 1}]")
    n = b.size
    base = ProbeConfig(b, _seeds(seed, n))
    fresh = _seeds(seed + 1, 3 * n).reshape(3, n)
    out = np.empty(n)
    evaluate = _Gradients(grad)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite estimates are capped
        if not robust:
            g0 = evaluate(base)
            for i in range(n):
                d = g0 - evaluate(base.reseeded([i], [fresh[0, i]]))
                out[i] = d @ d / (2.0 * variance_factor(int(b[i])))
            return _cap(out, cap)
        s_lo, s_hi = variance_factor(1), variance_factor(high)
        for i in range(n):
            ga = evaluate(base.with_bits([i], [1]).reseeded([i], [fresh[0, i]]))
            gb = evaluate(base.with_bits([i], [1]).reseeded([i], [fresh[1, i]]))
            gc = evaluate(base.with_bits([i], [high]).reseeded([i], [fresh[2, i]]))
            d_ab, d_ac, d_bc = ga - gb, ga - gc, gb - gc
            est = (
                d_ab @ d_ab / (2 * s_lo),
                d_ac @ d_ac / (s_lo + s_hi),
                d_bc @ d_bc / (s_lo + s_hi),
            )
            out[i] = max(est)
    return _cap(out, cap)


def min_pair_probes(n_items: int) -> int:
    """Smallest ``K`` with ``K(K-1)/2 >= n_items`` (and ``K >= 2``).

    Example:
        >>> min_pair_probes(150)
        18
    """
    n_items = integer_scalar(n_items, "n_items")
    if n_items < 0:
        raise ValueError(f"n_items must be >= 0, got {n_items}")
    k = max(2, math.ceil((1 + math.sqrt(1 + 8 * n_items)) / 2))
    while k * (k - 1) // 2 < n_items:
        k += 1
    return k


def _pairs(num_probes: int, count: int) -> list[tuple[int, int]]:
    """``count`` distinct probe pairs, in round-robin rounds so every probe carries ~2L/K items.

    Circle method: each round is a perfect matching of the probes (one dummy when ``K`` is odd),
    and the ``K - 1`` (or ``K``) rounds together contain every pair exactly once.
    """
    m = num_probes + num_probes % 2
    ring = list(range(1, m))
    pairs: list[tuple[int, int]] = []
    for r in range(m - 1):
        order = [0, *ring[r:], *ring[:r]]
        for i in range(m // 2):
            a, b = sorted((order[i], order[m - 1 - i]))
            if b < num_probes:
                pairs.append((a, b))
        if len(pairs) >= count:
            break
    return pairs[:count]


def pairwise_sensitivity(
    grad: GradFn,
    bits: ArrayLike,
    *,
    num_probes: int | None = None,
    seed: int = 0,
    cap: float = SENSITIVITY_CAP,
    stderr: bool = False,
) -> np.ndarray | SensitivityEstimate:
    """Cheap estimator from pairwise inner products of probe differences (``1 + K`` evaluations).

    Args:
        grad: gradient callable, see :data:`GradFn`.
        bits: probe width per item (quantised).
        num_probes: ``K``; default and minimum :func:`min_pair_probes` ``(L)``. More probes spread
            the items thinner (about ``2L/K`` per probe) and reduce the error.
        seed: root seed (base seeds, fresh seeds and the item-to-pair assignment; ``>= 0``).
        cap: replacement for non-finite estimates and upper bound (finite, ``> 0``); negative
            estimates become 0.
        stderr: also return each estimate's standard error (NOTE [Sensitivity estimators]).

    Returns:
        float64 array of ``c_l``; with ``stderr=True`` a :class:`SensitivityEstimate`.

    Raises:
        TypeError: on non-numeric arguments.
        ValueError: on invalid widths or options, too few probes, or if ``grad`` changes its
            output length.

    Example:
        >>> g = lambda cfg: sum(np.random.default_rng(int(s)).normal(size=4000) for s in cfg.seeds)
        >>> c = pairwise_sensitivity(g, [1, 1, 1])  # true c_l = 4000
        >>> bool(np.all(np.abs(c / 4000 - 1) < 0.2))
        True
    """
    b = _probe_bits(bits)
    seed, cap = _check_options(seed, cap)
    n = b.size
    k = min_pair_probes(n) if num_probes is None else integer_scalar(num_probes, "num_probes")
    if k < min_pair_probes(n):
        raise ValueError(f"num_probes: need at least {min_pair_probes(n)} for {n} items, got {k}")
    rng = np.random.default_rng([seed, 1])
    pairs = np.array(_pairs(k, n), dtype=np.int64).reshape(n, 2)[rng.permutation(n)]
    base = ProbeConfig(b, _seeds(seed, n))
    fresh = _seeds(seed + 1, 2 * n).reshape(n, 2)
    evaluate = _Gradients(grad)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite estimates are capped
        g0 = evaluate(base)
        # The K differences fill one preallocated K x D float32 matrix, each row divided by its
        # largest magnitude (kept in float64), and are squared in place for the standard
        # errors: memory 4·K·D bytes once. All pairwise inner products come at once from its
        # K x K Gram matrix, never from the O(L·D) of gathering one row pair per item (GBs for
        # a transformer's gradient). Rows in [-1, 1] keep float32's relative precision (about
        # 6e-8 of |e_i| |e_j| per inner product) far below the estimator's own noise.
        e = np.empty((k, g0.size), dtype=np.float32)
        scale = np.ones(k)
        for j in range(k):
            items, side = np.nonzero(pairs == j)
            d = g0 - evaluate(base.reseeded(items, fresh[items, side]))
            top = float(np.max(np.abs(d))) if d.size else 0.0
            if not np.isfinite(top):
                d.fill(np.nan)  # non-finite gradients give non-finite (capped) estimates
            elif top > 0:
                scale[j] = top
                d /= top
            e[j] = d
        gram = (e @ e.T).astype(np.float64) * np.outer(scale, scale)
        inner = gram[pairs[:, 0], pairs[:, 1]]
        value = _cap(inner / variance_factor(b), cap)
        if not stderr:
            return value
        np.square(e, out=e)
        squares = np.outer(scale, scale) ** 2
        spread = ((e @ e.T).astype(np.float64) * squares)[pairs[:, 0], pairs[:, 1]]
        return SensitivityEstimate(value, _cap(np.sqrt(spread) / variance_factor(b), cap))
