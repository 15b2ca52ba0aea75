"""fit_piecewise_constant: exact against brute force, and its edge cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gact_policy import fit_piecewise_constant


def _sse(y, w, starts):
    ends = [*starts[1:], len(y)]
    total = 0.0
    for s, e in zip(starts, ends):
        mean = np.average(y[s:e], weights=w[s:e])
        total += float(np.sum(w[s:e] * (y[s:e] - mean) ** 2))
    return total


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("pieces", [1, 2, 3, 4])
def test_matches_brute_force_over_every_segmentation(seed, pieces):
    rng = np.random.default_rng(seed)
    y = np.cumsum(rng.standard_normal(11))
    w = rng.uniform(0.1, 2.0, 11)
    fit = fit_piecewise_constant(y, pieces, w)
    best = min(
        _sse(y, w, [0, *cuts])
        for k in range(pieces)
        for cuts in itertools.combinations(range(1, 11), k)
    )
    assert fit.sse == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert _sse(y, w, fit.starts) == pytest.approx(fit.sse, rel=1e-9, abs=1e-12)
    assert fit.starts[0] == 0 and np.all(np.diff(fit.starts) > 0) and len(fit.starts) <= pieces
    ends = np.append(fit.starts[1:], 11)
    for s, e, level in zip(fit.starts, ends, fit.levels):
        assert level == pytest.approx(np.average(y[s:e], weights=w[s:e]))


def test_a_step_function_is_found_exactly_with_the_fewest_pieces():
    y = np.repeat([0.0, 1.0, 0.5], [4, 3, 5])
    fit = fit_piecewise_constant(y, 8)
    assert fit.starts.tolist() == [0, 4, 7] and fit.levels.tolist() == [0.0, 1.0, 0.5]
    assert fit.sse == 0.0


def test_more_pieces_than_values_and_zero_weights():
    fit = fit_piecewise_constant([3.0, 1.0], 5)
    assert fit.starts.tolist() == [0, 1] and fit.sse == 0.0
    fit = fit_piecewise_constant([0.0, 5.0, 1.0], 2, weights=[1.0, 0.0, 1.0])
    assert fit.sse == 0.0


@pytest.mark.parametrize(
    "values, pieces, weights, match",
    [
        ([], 2, None, "non-empty"),
        ([1.0, np.nan], 2, None, "finite"),
        ([1.0, 2.0], 0, None, "pieces"),
        ([1.0, 2.0], 2.0, None, "pieces"),
        ([1.0, 2.0], True, None, "pieces"),
        ([1.0, 2.0], 2, [1.0], "weights"),
        ([1.0, 2.0], 2, [1.0, -1.0], "weights"),
        ([1.0, 2.0], 2, [1.0, np.inf], "weights"),
    ],
)
def test_bad_input_raises_a_clear_error(values, pieces, weights, match):
    with pytest.raises(ValueError, match=match):
        fit_piecewise_constant(values, pieces, weights)
