"""Closed-form checks of the variance model."""

import numpy as np
import pytest
from gact_policy import FULL_PRECISION, predicted_variance, variance_factor


@pytest.mark.parametrize("bits", range(1, FULL_PRECISION))
def test_closed_form(bits: int) -> None:
    assert variance_factor(bits) == pytest.approx(1.0 / (2**bits - 1) ** 2, rel=1e-15)


def test_known_values_and_full_precision() -> None:
    assert variance_factor(1) == 1.0
    assert variance_factor(2) == pytest.approx(1 / 9)
    assert variance_factor(8) == pytest.approx(1 / 65025)
    assert variance_factor([16, 32]).tolist() == [0.0, 0.0]


def test_strictly_decreasing_and_convex() -> None:
    s = variance_factor(np.arange(1, FULL_PRECISION))
    assert np.all(np.diff(s) < 0)
    assert np.all(np.diff(s, 2) > 0)


def test_matches_stochastic_rounding_bound() -> None:
    rng = np.random.default_rng(0)
    x = rng.random(200_000)
    for bits in (1, 2, 4):
        delta = 1.0 / (2**bits - 1)
        low = np.floor(x / delta)
        frac = x / delta - low
        q = (low + (rng.random(x.size) < frac)) * delta
        assert abs(np.mean(q - x)) < 5e-3 * delta  # unbiased
        # Range R = 1, so Δ² = S(b) and the variance bound Δ²/4 is S(b)/4.
        assert np.var(q - x) <= variance_factor(bits) / 4 * 1.01


def test_predicted_variance() -> None:
    assert predicted_variance([1.0, 9.0, 5.0], [1, 2, 32]) == pytest.approx(2.0)
    assert predicted_variance([], []) == 0.0
    with pytest.raises(ValueError):
        predicted_variance([-1.0], [2])


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_invalid_bits(bad: float) -> None:
    with pytest.raises(ValueError):
        variance_factor(bad)
