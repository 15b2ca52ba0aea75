"""Charts start at zero and stop at the metric's limit; level labels say what a level stores."""

from __future__ import annotations

import matplotlib
import pytest
from gact_examples import charts
from gact_examples.levels import bits_label, level_label

matplotlib.use("Agg")


def _axes(panel: charts.Panel):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    charts._draw(ax, panel)
    return fig, ax


def test_accuracy_axis_starts_at_zero_and_ends_at_100():
    fig, ax = _axes(
        charts.Panel("acc (%)", ["fp32", "L2"], [99.4, 98.9], ["99.4", "98.9"], limit=100)
    )
    assert ax.get_ylim()[0] == 0  # a 0.5-point gap is not magnified
    assert max(ax.get_yticks()) <= 100  # no tick past 100 %
    assert ax.spines["left"].get_bounds() == (0, 100)
    assert [t.get_text() for t in ax.texts] == ["99.4", "98.9"]
    fig.clf()


def test_no_error_bars_unless_given():
    fig, ax = _axes(charts.Panel("MiB", ["fp32", "L2"], [4.0, 0.5]))
    (bars,) = ax.containers
    assert bars.errorbar is None  # single-seed values carry no error bars
    fig.clf()
    fig, ax = _axes(charts.Panel("MiB", ["fp32", "L2"], [4.0, 0.5], errors=[0.1, 0.1]))
    bars = next(c for c in ax.containers if hasattr(c, "errorbar"))
    assert bars.errorbar is not None
    fig.clf()


def test_panel_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 notes for 3 labels"):
        charts.Panel("t", ["a", "b", "c"], [1.0, 2.0, 3.0], notes=["x", "y"])


def test_bar_chart_needs_a_panel(tmp_path):
    with pytest.raises(ValueError, match="at least one panel"):
        charts.bar_chart(tmp_path / "x.png", "t", [])


def test_level_labels():
    assert [level_label(lv) for lv in ("L0", "L1", "L2")] == ["fp32", "L1", "L2"]
    assert [bits_label(lv) for lv in ("L0", "L1.1", "L2", "L3")] == [
        "32 bit",
        "8 bit",
        "adaptive, 4 bit avg",
        "adaptive, 4 bit avg + swap",
    ]
    with pytest.raises(KeyError, match="valid levels"):
        bits_label("L9")
