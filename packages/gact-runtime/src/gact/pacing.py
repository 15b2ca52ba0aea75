"""When an adaptive level adapts and when it measures: the steps its schedule makes due, within
its time budget (NOTE [Adaptation schedule] in gact_policy, NOTE [Measuring steps] below)."""

from __future__ import annotations

from .adapt import Adapter, rank_zeros
from .hooks import SaveHooks
from .ledger import Ledger
from .measured import SensitivityMeter
from .plan import BitPlan

__all__ = ["Pacing"]


class Pacing:
    """The adaptation schedule of a ``Controller``'s steps, against the time spent training.

    Args:
        plan: the controller's bit plan (its config and step count).
        adapter: what adapts: its cost so far and of its last adaptations.
        hooks: the save hooks, whose meter a measuring step attaches.
        ledger: the open step's saves.

    Attributes:
        probe_fraction: a probe's share of a training step, as the last ``iterate()`` said: it
            predicts a first adaptation's cost.
        step_seconds: seconds between step boundaries so far, all of them.
        unmeasured: items the last meter left to probes (``None`` before any measurement).
    """

    def __init__(self, plan: BitPlan, adapter: Adapter, hooks: SaveHooks, ledger: Ledger) -> None:
        self.plan = plan
        self.adapter = adapter
        self.hooks = hooks
        self.ledger = ledger
        self.probe_fraction = 1.0
        self.step_seconds = 0.0
        self.unmeasured: int | None = None

    @property
    def due(self) -> bool:
        """Whether the open step adapts with probes (``Controller.adaptation_due``)."""
        if not self.scheduled():
            return False
        if self.plan.step == 0:
            return True  # the original GACT's schedule: nothing to charge it against yet
        meter = self.hooks.meter
        if meter is not None:  # the step measured what it could (spent): the rest needs probes
            return self.affordable(self.adapter.unmeasured(self.ledger.current, meter))
        return self.affordable(None)

    def affordable(self, probed: int | None) -> bool:
        """Whether the time budget affords an adaptation that probes ``probed`` items
        (``None``: as many as the last adaptation, or every item before any; 0: one that only
        measures, at the cost of the last one that did)."""
        cfg, adapter = self.plan.config, self.adapter
        trained = self.trained_seconds()
        per_step = trained / max(self.plan.step, 1)
        if probed is None or (probed and adapter.last_probed):
            cost = adapter.last_seconds or adapter.predicted_cost(per_step, self.probe_fraction)
        elif probed == 0:  # the measurement is not free: the last measuring one's cost
            cost = adapter.last_held_seconds if adapter.last_probed else adapter.last_seconds
        else:
            cost = adapter.predicted_cost(per_step, self.probe_fraction, probed)
        return cfg.schedule.affordable(
            adapted_seconds=adapter.seconds, trained_seconds=trained, cost_seconds=cost
        )

    def trained_seconds(self) -> float:
        """Seconds between step boundaries spent on anything but adapting and compiling (NOTE
        [Compile time] in compiled.py)."""
        compiling = self.hooks.compile_clock.seconds - self.adapter.compile_seconds
        return self.step_seconds - self.adapter.seconds - compiling

    def scheduled(self) -> bool:
        """Whether the schedule alone makes the open step an adaptation's (the time budget
        aside): the same on every rank."""
        cfg, adapter, step = self.plan.config, self.adapter, self.plan.step
        if not cfg.spec.adaptive:
            return False
        if step == 0:
            return cfg.adapt_first_gap == 0  # the original GACT's schedule
        last = 0 if adapter.last_step is None else adapter.last_step
        return cfg.schedule.due(step, last=last)

    def adapting(self) -> str | None:
        """How the open step adapts, rank 0's choice under torch.distributed (the budget check
        reads each rank's own clock; ranks that disagreed would wait for each other's probes
        forever): ``"probes"`` when due and affordable, ``"measured"`` when it measured but
        cannot afford the probes (NOTE [Held tensors] in adapt.py), else ``None``."""
        if not self.scheduled():
            return None
        if self.due:
            adapting: str | None = "probes"
        else:
            adapting = "measured" if self.hooks.meter is not None else None
        return rank_zeros(adapting)

    # NOTE [Measuring steps]
    # A step is measured (NOTE [Measured sensitivities] in measured.py) when the schedule makes
    # it an adaptation's and the adaptation it serves looks affordable: the first time always
    # (it tells which tensors need probes), then when the budget affords probing the tensors
    # the last measurement left to probes, and, while those probes wait for the budget, on the
    # schedule's steps counted from the last adaptation of any kind (first_gap, twice that,
    # ...), if the budget affords the last measuring adaptation's cost again. A model with
    # nothing to probe measures when the budget affords its last measurement's cost (predicted
    # to cost nothing, a measurement ran whenever the time already spent was within the budget:
    # 5.8-6.3% of the MNIST example's training time). Such a step
    # adapts the measured tensors and holds the others (NOTE [Held tensors] in adapt.py). So
    # the measured tensors follow training at a fraction of a step per adaptation (a
    # transformer's queries, insensitive at initialisation, are not left at 1 bit until the
    # probes are affordable: 250 steps on the LLaMA-style decoder), and an adaptation that
    # waits does not pay a measurement at every step.
    def arm(self) -> None:
        """Attach a meter to the open step if it is a measuring one (NOTE above)."""
        if (
            self.hooks.meter is None
            and not self.hooks.probing
            and self.plan.config.measure_linear
            and self.scheduled()
            and (self.unmeasured is None or self.affordable(self.unmeasured) or self.remeasuring())
        ):
            self.hooks.meter = SensitivityMeter(batch_norms=self.adapter.batch_norms)
            self.hooks.meter.start()

    def remeasuring(self) -> bool:
        """Whether the open step measures again while the probes wait (NOTE above)."""
        cfg, adapter = self.plan.config, self.adapter
        last = adapter.last_adapted
        if not self.unmeasured:
            return False  # no probe waits: ``affordable(0)`` decides
        if last is None or not cfg.schedule.due(self.plan.step, last=last):
            return False  # none adapted yet: measuring again would measure every step
        return cfg.schedule.affordable(
            adapted_seconds=adapter.seconds,
            trained_seconds=self.trained_seconds(),
            cost_seconds=adapter.last_held_seconds,
        )

    def discard(self) -> None:
        """Drop the open step's meter unread: the step's closure failed, and a retry's forward
        arms a fresh one (the failed forward's measurements, unfinished, made the retry's
        adaptation measure nothing)."""
        meter, self.hooks.meter = self.hooks.meter, None
        if meter is not None:
            meter.stop()
            self.adapter.seconds += meter.seconds

    def disarm(self) -> SensitivityMeter | None:
        """Stop the open step's meter; returns it (``None`` if none ran)."""
        meter, self.hooks.meter = self.hooks.meter, None
        if meter is not None:
            meter.stop()
            self.adapter.seconds += meter.seconds
            self.unmeasured = self.adapter.unmeasured(self.ledger.current, meter)
        return meter
