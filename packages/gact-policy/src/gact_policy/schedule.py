"""When to re-estimate sensitivities: early and often while training changes fast, never more
than a time budget allows."""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import integer_scalar, real_scalar

__all__ = ["AdaptationSchedule"]

# NOTE [Adaptation schedule]
# Sensitivities at initialisation are not those of training: on the char-GPT example the
# attention probabilities are the least sensitive tensor at step 0 and the most sensitive at
# step 100 (BENCHMARKS.md, "Why adaptive bits lost"). An allocation made once at step 0 and kept
# for ``interval`` steps is therefore wrong for most of a short run. The schedule adapts at step
# 0, at the doubling steps ``first_gap``, 2·``first_gap``, 4·``first_gap``, ... below
# ``interval``, and at every multiple of ``interval`` (as the original GACT did). A scheduled
# adaptation other than the first waits while it would make the time spent adapting exceed
# ``budget`` times the time spent training (its cost is predicted by the previous adaptation's),
# so short runs and expensive probes adapt less often instead of running slower; a waiting
# adaptation runs as soon as it is affordable, and the next one is scheduled after it. The
# predicted cost is counted ``margin`` times (1.25): on a shared machine an adaptation can take
# longer than the one before it, and the budget is a bound users rely on (a CiteSeer run's
# second adaptation took 7.66 s after 7.06 s and ended at 5.5% without the margin).
# Reading the clock makes the adaptations, and so the training, depend on the machine's speed
# at the moment: the same seed gave final losses 1.337 and 1.462 in two runs of the ResNet-18
# layout at L2 (BENCHMARKS.md, "Reproducible adaptive runs"). ``budget=None`` sets no budget:
# every scheduled adaptation runs, and which ones run depends on the steps alone.


@dataclass(frozen=True)
class AdaptationSchedule:
    """Which training steps re-estimate sensitivities.

    Args:
        interval: the largest gap, in steps, between adaptations (``>= 1``).
        first_gap: the gap after the first adaptation (step 0); gaps double up to ``interval``.
        budget: adapting may take at most this fraction of the training time (``>= 0``;
            ``0`` adapts only at step 0); ``None`` sets no budget (every scheduled adaptation
            runs: reproducible, see NOTE [Adaptation schedule]).
        margin: the predicted cost of an adaptation is counted this many times (``>= 1``), so
            that one dearer than predicted still keeps within ``budget``.

    Example:
        >>> schedule = AdaptationSchedule(interval=100, first_gap=10)
        >>> steps, last = [], None
        >>> for step in range(350):
        ...     if schedule.due(step, last=last):
        ...         steps.append(step)
        ...         last = step
        >>> steps
        [0, 10, 20, 40, 80, 100, 200, 300]
        >>> schedule.affordable(adapted_seconds=3.5, trained_seconds=100.0, cost_seconds=1.0)
        True
        >>> schedule.affordable(adapted_seconds=4.0, trained_seconds=100.0, cost_seconds=1.0)
        False
    """

    interval: int = 1000
    first_gap: int = 10
    budget: float | None = 0.05
    margin: float = 1.25

    def __post_init__(self) -> None:
        interval = integer_scalar(self.interval, "interval")
        first_gap = integer_scalar(self.first_gap, "first_gap")
        budget = None if self.budget is None else real_scalar(self.budget, "budget")
        margin = real_scalar(self.margin, "margin")
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if first_gap < 1:
            raise ValueError(f"first_gap must be >= 1, got {first_gap}")
        if budget is not None and not 0 <= budget < float("inf"):
            raise ValueError(f"budget must be a fraction >= 0 or None, got {budget}")
        if not 1 <= margin < float("inf"):
            raise ValueError(f"margin must be a finite number >= 1, got {margin}")
        object.__setattr__(self, "interval", interval)
        object.__setattr__(self, "first_gap", min(first_gap, interval))
        object.__setattr__(self, "budget", budget)
        object.__setattr__(self, "margin", margin)

    def next_after(self, step: int) -> int:
        """The first scheduled step after ``step``."""
        step = integer_scalar(step, "step")
        nxt = (step // self.interval + 1) * self.interval
        early = self.first_gap
        while early < self.interval and early <= step:
            early *= 2
        return early if step < early < min(nxt, self.interval) else nxt

    def due(self, step: int, *, last: int | None) -> bool:
        """Whether an adaptation is due at ``step``, the last one having run at ``last``
        (``None``: never, so step 0, or the first step seen, is due)."""
        step = integer_scalar(step, "step")
        return last is None or step >= self.next_after(last)

    def affordable(
        self, *, adapted_seconds: float, trained_seconds: float, cost_seconds: float
    ) -> bool:
        """Whether one more adaptation predicted to cost ``cost_seconds`` keeps the time spent
        adapting within ``budget`` of the time spent training, even if it costs ``margin``
        times more (always, without a budget)."""
        if self.budget is None:
            return True
        return adapted_seconds + self.margin * cost_seconds <= self.budget * trained_seconds
