"""The best piecewise-constant approximation of a sequence: Few-bit backward's derivative tables.

A pointwise function's backward needs ``f'(x)`` only. Storing, per element, which of ``K``
intervals of ``x`` it falls in and one value per interval (Few-bit backward, Novikov et al.,
ICML 2022) costs ``log2 K`` bits; the intervals and values that minimise the squared error of
``f'`` over a sample of ``x`` are the best segmentation of the sorted sample's ``f'`` values into
``K`` contiguous pieces, which dynamic programming finds exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from numpy.typing import ArrayLike

from ._checks import real_array

__all__ = ["PiecewiseFit", "fit_piecewise_constant"]


@dataclass(frozen=True)
class PiecewiseFit:
    """A segmentation of a sequence into contiguous pieces.

    Args:
        starts: index of each piece's first element (``starts[0] == 0``, increasing).
        levels: the weighted mean of each piece, the value that approximates it.
        sse: the weighted sum of squared errors of the approximation.
    """

    starts: np.ndarray
    levels: np.ndarray
    sse: float


def fit_piecewise_constant(
    values: ArrayLike, pieces: int, weights: Optional[ArrayLike] = None
) -> PiecewiseFit:
    """Split ``values`` into at most ``pieces`` contiguous pieces minimising the weighted squared
    error of each piece's mean (exact: dynamic programming, ``O(pieces n^2)`` time, ``O(pieces n)``
    memory, so ``n`` of a few thousand at most; bin a larger sample first and pass the bins'
    means with their counts as ``weights``).

    Args:
        values: the sequence (1-D, finite), in the order of the variable the pieces are
            intervals of (for a derivative table: ``f'`` at sorted ``x``).
        pieces: the most pieces (``2**bits`` for a ``bits``-bit table), at least 1.
        weights: non-negative weight of each value (default 1).

    Raises:
        ValueError: empty or non-finite ``values``, negative or mis-sized ``weights``, or
            ``pieces < 1``.

    Example:
        >>> fit = fit_piecewise_constant([0.0, 0.0, 1.0, 1.0, 1.0], 2)
        >>> fit.starts.tolist(), fit.levels.tolist(), fit.sse
        ([0, 2], [0.0, 1.0], 0.0)
    """
    y = real_array(values, "values")
    if y.size == 0 or not np.all(np.isfinite(y)):
        raise ValueError("values must be a non-empty sequence of finite numbers")
    if isinstance(pieces, bool) or not isinstance(pieces, (int, np.integer)) or pieces < 1:
        raise ValueError(f"pieces must be an int >= 1, got {pieces!r}")
    w = np.ones_like(y) if weights is None else real_array(weights, "weights")
    if w.shape != y.shape or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and non-negative, one per value")
    n, k_max = y.size, min(int(pieces), y.size)
    # prefix sums: the error of y[i:j] as one piece is S2 - S1^2 / W over it
    cw, c1, c2 = (np.concatenate([[0.0], np.cumsum(a)]) for a in (w, w * y, w * y * y))

    def cost(i: np.ndarray, j: int) -> np.ndarray:
        total = cw[j] - cw[i]
        mean_sq = np.divide((c1[j] - c1[i]) ** 2, total, out=np.zeros_like(total), where=total > 0)
        return np.maximum(c2[j] - c2[i] - mean_sq, 0.0)

    best = np.full((k_max + 1, n + 1), np.inf)
    arg = np.zeros((k_max + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, k_max + 1):
        for j in range(k, n + 1):
            i = np.arange(k - 1, j)
            total = best[k - 1, k - 1 : j] + cost(i, j)
            m = int(np.argmin(total))
            arg[k, j], best[k, j] = i[m], total[m]
    k = int(np.argmin(best[1:, n])) + 1  # fewer pieces can be as good (ties: the fewest)
    starts, j = [], n
    while k > 0:
        i = int(arg[k, j])
        starts.append(i)
        j, k = i, k - 1
    starts = np.array(starts[::-1], dtype=np.int64)
    ends = np.append(starts[1:], n)
    levels = np.array(
        [(c1[e] - c1[s]) / (cw[e] - cw[s]) if cw[e] > cw[s] else 0.0 for s, e in zip(starts, ends)]
    )
    return PiecewiseFit(starts=starts, levels=levels, sse=float(best[len(starts), n]))
