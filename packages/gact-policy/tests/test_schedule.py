"""The adaptation schedule: doubling gaps early, every interval later, within a time budget."""

from __future__ import annotations

import pytest
from gact_policy import AdaptationSchedule
from hypothesis import given
from hypothesis import strategies as st


def _run(schedule: AdaptationSchedule, steps: int) -> list[int]:
    out, last = [], None
    for step in range(steps):
        if schedule.due(step, last=last):
            out.append(step)
            last = step
    return out


def test_early_doubling_then_every_interval() -> None:
    assert _run(AdaptationSchedule(interval=1000, first_gap=10), 3001) == [
        0, 10, 20, 40, 80, 160, 320, 640, 1000, 2000, 3000,
    ]  # fmt: skip
    assert _run(AdaptationSchedule(interval=5, first_gap=10), 16) == [0, 5, 10, 15]
    assert _run(AdaptationSchedule(interval=1, first_gap=1), 4) == [0, 1, 2, 3]


@given(st.integers(1, 500), st.integers(1, 100), st.integers(0, 5000))
def test_next_is_after_and_never_further_than_an_interval(
    interval: int, first_gap: int, step: int
) -> None:
    schedule = AdaptationSchedule(interval=interval, first_gap=first_gap)
    nxt = schedule.next_after(step)
    assert step < nxt <= (step // interval + 1) * interval
    assert schedule.due(nxt, last=step) and not schedule.due(nxt - 1, last=step)


def test_a_waiting_adaptation_runs_when_affordable() -> None:
    schedule = AdaptationSchedule(interval=100, first_gap=10, budget=0.05)
    assert not schedule.affordable(adapted_seconds=1.0, trained_seconds=10.0, cost_seconds=1.0)
    assert schedule.affordable(adapted_seconds=1.0, trained_seconds=40.0, cost_seconds=1.0)
    assert schedule.due(37, last=0)  # scheduled at 10, still due while it waits
    zero = AdaptationSchedule(budget=0.0)
    assert not zero.affordable(adapted_seconds=0.0, trained_seconds=1e9, cost_seconds=1e-9)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"interval": 0}, ValueError),
        ({"first_gap": 0}, ValueError),
        ({"budget": -0.1}, ValueError),
        ({"budget": float("nan")}, ValueError),
        ({"interval": True}, TypeError),
        ({"budget": "0.05"}, TypeError),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        AdaptationSchedule(**kwargs)
