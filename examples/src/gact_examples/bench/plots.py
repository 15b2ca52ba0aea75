"""The benchmark's charts: final metric per level, and activation memory per level."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..charts import Panel, bar_chart
from ..levels import BASELINE, chart_label
from ..runs import mean_std
from .specs import Example, Plan

__all__ = ["plot"]

MIB = 1 / 2**20


def _labels(levels: tuple[str, ...]) -> list[str]:
    return [chart_label(lv) for lv in levels]


def _metric_panel(plan: Plan, ex: Example, runs: dict[str, list[dict[str, Any]]]) -> Panel:
    stats = [mean_std([r.get("final_metric") for r in runs.get(lv, [])]) for lv in plan.levels]
    scale, digits = ex.metric.scale, ex.metric.digits
    means = [m * scale for m, _, _ in stats]
    several = all(n > 1 for _, _, n in stats)
    return Panel(
        f"{ex.title}\n{ex.metric.label}",
        _labels(plan.levels),
        means,
        notes=["" if math.isnan(m) else f"{m:.{digits}f}" for m in means],
        errors=[s * scale for _, s, _ in stats] if several else None,
        limit=ex.metric.limit,
    )


def _saved_panel(plan: Plan, ex: Example, runs: dict[str, list[dict[str, Any]]]) -> Panel:
    stored = [mean_std([r.get("stored_bytes") for r in runs.get(lv, [])])[0] for lv in plan.levels]
    fp32 = stored[plan.levels.index(BASELINE)] if BASELINE in plan.levels else math.nan
    notes = [
        "" if math.isnan(s) or math.isnan(fp32) or lv == BASELINE else f"{fp32 / s:.1f}x less"
        for lv, s in zip(plan.levels, stored)
    ]
    return Panel(
        f"{ex.title}\nsaved activations (MiB/step)",
        _labels(plan.levels),
        [s * MIB for s in stored],
        notes,
    )


def _peak_panel(plan: Plan, ex: Example, runs: dict[str, list[dict[str, Any]]]) -> Panel:
    levels = plan.own_levels  # the memory runs'
    peaks = [
        ((runs.get(lv) or [{}])[0].get("peak_memory_delta_bytes") or math.nan) for lv in levels
    ]
    fp32 = peaks[levels.index(BASELINE)] if BASELINE in levels else math.nan
    notes = [
        "" if math.isnan(p) or math.isnan(fp32) or lv == BASELINE else f"{fp32 / p:.1f}x less"
        for lv, p in zip(levels, peaks)
    ]
    return Panel(
        f"{ex.title}\npeak memory over baseline (MiB)\n{ex.mem_title}",
        _labels(levels),
        [p * MIB for p in peaks],
        notes,
    )


def plot(plan: Plan, results: dict[str, Any], folder: Path) -> list[Path]:
    """Write ``examples_metric.png`` and ``examples_memory.png`` into ``folder``.

    Returns:
        The files written (none when ``results`` holds no training runs).
    """
    examples = [ex for ex in plan.examples if results["train"].get(ex.name)]
    if not examples:
        return []
    seeds = f"mean ± std over {plan.seeds} seeds" if plan.seeds > 1 else "one seed"
    written = [folder / "examples_metric.png", folder / "examples_memory.png"]
    bar_chart(
        written[0],
        f"Final metric per GACT level ({seeds}; fp32 = level L0)",
        [_metric_panel(plan, ex, results["train"][ex.name]) for ex in examples],
        ncols=3,
    )
    panels = [_saved_panel(plan, ex, results["train"][ex.name]) for ex in examples]
    panels += [
        _peak_panel(plan, ex, results["mem"][ex.name])
        for ex in examples
        if results["mem"].get(ex.name)
    ]
    bar_chart(
        written[1],
        "Activation memory per GACT level (notes: how many times less than fp32)",
        panels,
        ncols=3,
        footnote=(
            "Saved activations: what autograd holds for backward in one training step, metadata "
            "included. Peak memory falls much less: weights, gradients, optimizer state and the "
            "backward pass's working set are not compressed."
        ),
    )
    return written
