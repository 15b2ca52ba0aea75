"""Markdown tables from the records of ``stability.py``: divergence, final loss against fp32, and
the quantization / minibatch variance ratio per layer over training.

    python examples/stability_report.py resnet18_lr0.05.json resnet18_lr0.1.json vit.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["divergence_table", "variance_table"]

LEVEL_ORDER = ("L0", "L1.1", "L1", "L2", "L1.2", "L2.2")


def _levels(records: list[dict[str, Any]]) -> list[str]:
    present = {r["level"] for r in records}
    return [lv for lv in LEVEL_ORDER if lv in present] + sorted(present - set(LEVEL_ORDER))


def divergence_table(records: list[dict[str, Any]]) -> str:
    """Per model, learning rate and level: the step of the first NaN in each seed ("-" for
    none), the final loss (mean over seeds that finished) and its change against fp32's, the
    largest gradient norm, and the adaptations each seed's run made ("?" in records that
    predate the field)."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["model"], r["layout"], r["lr"])].append(r)
    lines = [
        "| model | lr | level | first NaN per seed | final loss (mean ± sd) | vs fp32 | "
        "largest gradient norm | adaptations per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (model, layout, lr), runs in sorted(groups.items()):
        base = [r["final_loss"] for r in runs if r["level"] == "L0"]
        base_mean = statistics.fmean(base) if base else math.nan
        for level in _levels(runs):
            at = sorted((r for r in runs if r["level"] == level), key=lambda r: r["seed"])
            nans = ", ".join(
                "-" if r["first_nan_step"] is None else str(r["first_nan_step"]) for r in at
            )
            done = [r["final_loss"] for r in at if r["first_nan_step"] is None]
            if done:
                sd = statistics.stdev(done) if len(done) > 1 else 0.0
                mean = statistics.fmean(done)
                loss = f"{mean:.3f} ± {sd:.3f}"
                delta = "" if level == "L0" else f"{100 * (mean / base_mean - 1):+.1f}%"
            else:
                loss, delta = "diverged", ""
            grad = max(r["max_grad_norm"] for r in at)
            name = model if layout == "channel" else f"{model} (memory-order groups)"
            adapted = ", ".join(str(r.get("adaptations", "?")) for r in at)
            lines.append(
                f"| {name} | {lr:g} | {level} | {nans} | {loss} | {delta} | {grad:.3g} "
                f"| {adapted} |"
            )
    return "\n".join(lines)


def _layer(parameter: str) -> str:
    """``layer4.1.bn2.weight`` -> ``layer4``; ``vit.encoder.layer.0....`` -> ``layer.0``."""
    match = re.search(r"(layer\d+|layers?\.\d+)", parameter)
    return match.group(1) if match else parameter.split(".")[0]


def variance_table(records: list[dict[str, Any]]) -> str:
    """Per model, learning rate and level, per layer and measured step: the largest ratio of
    rounding variance to minibatch variance over the layer's parameters and the seeds."""
    worst: dict[tuple[str, float, int, str], dict[str, dict[int, float]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for r in records:
        order = LEVEL_ORDER.index(r["level"]) if r["level"] in LEVEL_ORDER else len(LEVEL_ORDER)
        for step, ratios in r.get("variance_ratios", {}).items():
            for name, ratio in ratios.items():
                cell = worst[(r["model"], r["lr"], order, r["level"])][_layer(name)]
                cell[int(step)] = max(cell.get(int(step), 0.0), ratio)
    out = []
    for (model, lr, _, level), layers in sorted(worst.items()):
        steps = sorted({s for cells in layers.values() for s in cells})
        out.append(f"{model}, lr {lr:g} ({level}, largest over parameters and seeds):\n")
        out.append("| layer | " + " | ".join(f"step {s}" for s in steps) + " |")
        out.append("|---|" + "---|" * len(steps))
        for layer, cells in layers.items():
            row = " | ".join(f"{100 * cells[s]:.1f}%" if s in cells else "" for s in steps)
            out.append(f"| {layer} | {row} |")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="+", help="JSON files written by stability.py")
    args = p.parse_args(argv)
    records = [r for path in args.records for r in json.loads(Path(path).read_text())]
    text = divergence_table(records) + "\n\n" + variance_table(records)
    print(text)
    return text


if __name__ == "__main__":
    main()
