"""The adaptation schedule: doubling gaps early, every interval later, within a time budget."""

from __future__ import annotations

import numpy as np
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
    # 1 s adapted + 1.25 x 1 s predicted (the margin) must fit in 5%: 45 s of training
    assert not schedule.affordable(adapted_seconds=1.0, trained_seconds=44.0, cost_seconds=1.0)
    assert schedule.affordable(adapted_seconds=1.0, trained_seconds=45.0, cost_seconds=1.0)
    assert schedule.due(37, last=0)  # scheduled at 10, still due while it waits
    zero = AdaptationSchedule(budget=0.0)
    assert not zero.affordable(adapted_seconds=0.0, trained_seconds=1e9, cost_seconds=1e-9)


def test_without_a_budget_every_scheduled_adaptation_is_afforded() -> None:
    """``budget=None`` (NOTE [Adaptation schedule]): no clock reading can hold one back."""
    free = AdaptationSchedule(interval=100, first_gap=10, budget=None)
    assert free.affordable(adapted_seconds=1e9, trained_seconds=0.0, cost_seconds=1e9)
    steps, last = [], None
    for step in range(250):
        if free.due(step, last=last) and free.affordable(
            adapted_seconds=1e9, trained_seconds=1.0, cost_seconds=1e9
        ):
            steps.append(step)
            last = step
    assert steps == [0, 10, 20, 40, 80, 100, 200]


def _overhead(schedule: AdaptationSchedule, seed: int, steps: int = 2000) -> float:
    """Worst ratio of adapting to training time in a simulated run: steps of 1 s ± 20%, every
    adaptation costing 20 s, then up to 25% more or 20% less than the previous one (a shared
    machine: the runtime predicts an adaptation's cost by the last one's)."""
    rng = np.random.default_rng(seed)
    adapted = trained = 0.0
    last, cost, worst = None, 20.0, 0.0
    for step in range(steps):
        trained += rng.uniform(0.8, 1.2)
        if (
            step
            and schedule.due(step, last=last)
            and schedule.affordable(
                adapted_seconds=adapted, trained_seconds=trained, cost_seconds=cost
            )
        ):
            cost *= rng.uniform(0.8, 1.25)  # what this adaptation really takes
            adapted += cost
            last = step
            worst = max(worst, adapted / trained)
    return worst


@pytest.mark.parametrize("seed", range(20))
def test_timing_noise_never_breaks_the_budget(seed: int) -> None:
    """The budget is an upper bound users rely on (the examples report at most 5%): an
    adaptation up to 25% dearer than predicted still keeps within it. Without the margin, a
    cost above its prediction ran over (5.5% on a CiteSeer run: 7.06 s, then 7.66 s)."""
    schedule = AdaptationSchedule(interval=100, first_gap=10, budget=0.05)
    assert _overhead(schedule, seed) <= 0.05
    assert _overhead(AdaptationSchedule(interval=100, first_gap=10, budget=0.05, margin=1.0),
                     seed) > 0.03  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"interval": 0}, ValueError),
        ({"first_gap": 0}, ValueError),
        ({"budget": -0.1}, ValueError),
        ({"budget": float("nan")}, ValueError),
        ({"budget": float("inf")}, ValueError),  # None sets no budget
        ({"interval": True}, TypeError),
        ({"budget": "0.05"}, TypeError),
        ({"margin": 0.5}, ValueError),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        AdaptationSchedule(**kwargs)
