"""Exponential smoothing of sensitivities."""

import numpy as np
import pytest
from gact_policy import SENSITIVITY_CAP, SensitivityTracker, smooth


def test_smooth_formula_and_nan_robustness() -> None:
    assert smooth([1.0, 2.0], [3.0, 4.0], 0.75).tolist() == [1.5, 2.5]
    out = smooth([1.0, 2.0, 3.0], [np.nan, np.inf, 5.0], 0.5)
    assert out.tolist() == [1.0, 2.0, 4.0]
    assert smooth(None, [np.nan, 2.0], 0.9).tolist() == [SENSITIVITY_CAP, 2.0]


def test_smooth_errors() -> None:
    with pytest.raises(ValueError):
        smooth([1.0], [1.0, 2.0], 0.5)
    with pytest.raises(ValueError):
        smooth([1.0], [-1.0], 0.5)
    with pytest.raises(ValueError):
        smooth([1.0], [1.0], 1.0)


def test_tracker_state() -> None:
    t = SensitivityTracker(momentum=0.5)
    assert t.value is None
    t.update([2.0, 4.0])
    t.update([np.nan, 0.0])
    assert t.value.tolist() == [2.0, 2.0]
    assert np.all(np.isfinite(t.update([np.inf, np.inf])))
    t.reset()
    assert t.value is None
