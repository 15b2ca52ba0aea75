"""The examples section of BENCHMARKS.md: one function per table, assembled by :func:`render`.

``results`` is what ``examples/bench.py`` collects: ``{"train": {example: {level: [record,
...]}}, "mem": {...}, "max_batch": {example: {level: batch}}, "failures": [str], "missing":
[str], "wall_s": float | None}``, records being the scripts' JSON records.
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..levels import BASELINE, level_label, matched_level
from ..runs import fmt_mean_std, mean_std
from .specs import ADAPTIVE_PAIRS, TARGETS, Example, Plan, command_template

__all__ = [
    "BEGIN",
    "END",
    "Check",
    "activation_table",
    "adaptive_table",
    "max_batch_table",
    "memory_table",
    "metric_table",
    "render",
    "speed_table",
    "write_markdown",
]

BEGIN, END = "<!-- examples:begin -->", "<!-- examples:end -->"
MIB = 1 / 2**20
Records = Sequence[dict[str, Any]]


@dataclass(frozen=True)
class Check:
    """One row of the targets checklist."""

    name: str
    measured: str
    target: str
    met: str


def _stat(recs: Records, key: str, scale: float = 1.0) -> tuple[float, float, int]:
    m, s, n = mean_std([r.get(key) for r in recs])
    return m * scale, s * scale, n


def _runs(results: dict[str, Any], kind: str, ex: Example) -> dict[str, list[dict[str, Any]]]:
    return results[kind].get(ex.name, {})


def _first(runs: dict[str, list[dict[str, Any]]], level: str) -> dict[str, Any] | None:
    return (runs.get(level) or [None])[0]


def _header(first: str, levels: Sequence[str], *rest: str) -> list[str]:
    cols = [first, *(level_label(lv) for lv in levels), *rest]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _yes_no(met: bool, checked: bool = True) -> str:
    if met:
        return "yes"
    return "**no**" if checked else "no"


def metric_table(plan: Plan, results: dict[str, Any]) -> tuple[list[str], list[Check]]:
    """Final metric per level (mean ± std over seeds) and the L2 gap to fp32 against its target."""
    lines = ["### Final metric (test accuracy %, or validation loss in nats/char)\n"]
    lines += _header("example", plan.levels, "L2 − fp32", "target", "met")
    checks = []
    for ex in plan.examples:
        runs, metric = _runs(results, "train", ex), ex.metric
        cells = [ex.title]
        for level in plan.levels:
            m, s, n = _stat(runs.get(level, []), "final_metric", metric.scale)
            partial = f" (n={n})" if n and n != plan.seeds else ""
            cells.append(fmt_mean_std(m, s, metric.digits) + partial)
        fp32 = _stat(runs.get(BASELINE, []), "final_metric", metric.scale)[0]
        l2 = _stat(runs.get("L2", []), "final_metric", metric.scale)[0]
        gap = metric.gap(fp32, l2)
        target = metric.target_text(ex.target)
        met = "n/a" if math.isnan(gap) else _yes_no(metric.meets(gap, ex.target), ex.checked)
        gap_text = f"{gap:+.2f} {metric.gap_unit}"
        if ex.checked:
            checks.append(Check(f"{ex.title}: L2 metric gap", gap_text, target, met))
        else:
            target = f"(none; {target} for reference)"
        lines.append(_row([*cells, gap_text, target, met]))
    return [*lines, ""], checks


def _adaptive_pairs(plan: Plan) -> list[tuple[str, str]]:
    """(adaptive, uniform) pairs to compare: the adaptive level at the uniform level's bytes
    when the plan runs it (NOTE [Matched levels]), else at its own settings."""
    pairs = []
    for a, u in ADAPTIVE_PAIRS:
        m = matched_level(a, u)
        if u in plan.levels and (m in plan.levels or a in plan.levels):
            pairs.append((m if m in plan.levels else a, u))
    return pairs


def adaptive_table(plan: Plan, results: dict[str, Any]) -> tuple[list[str], list[Check]]:
    """Each adaptive level against the uniform level of its bits (``ADAPTIVE_PAIRS``) at equal
    stored bytes where the plan allows, checked for no loss beyond one standard error and for
    wins beyond one on ``TARGETS["adaptive_wins"]`` of the examples; and the adaptation cost of
    the adaptive levels against ``TARGETS["adaptation_cost"]``."""
    pairs = _adaptive_pairs(plan)
    if not pairs:
        return [], []
    lines = ["### Adaptive against uniform bits, and what adapting costs\n"]
    cols = ["example"]
    for a, u in pairs:
        cols += [f"{a} − {u}", "bytes", "verdict"]
    adaptive = [a for a, _ in ADAPTIVE_PAIRS if a in plan.levels]
    cols += [f"{a}: adaptations, cost" for a in adaptive]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    checks = []
    wins, judged = dict.fromkeys(pairs, 0), dict.fromkeys(pairs, 0)
    budget = TARGETS["adaptation_cost"]
    for ex in plan.examples:
        runs, metric = _runs(results, "train", ex), ex.metric
        cells = [ex.title]
        for a, u in pairs:
            ma, sa, na = _stat(runs.get(a, []), "final_metric", metric.scale)
            mu, su, nu = _stat(runs.get(u, []), "final_metric", metric.scale)
            # seed noise: one standard error of the difference of the two means (none from
            # one seed: no verdict then)
            se = math.sqrt(sa**2 / na + su**2 / nu) if na > 1 and nu > 1 else math.nan
            gap = metric.gap(mu, ma)
            se_gap = abs(metric.gap(mu, mu + se) if metric.higher_is_better else se / mu * 100)
            ok = not math.isnan(gap) and metric.meets(gap, se_gap)
            won = ok and metric.better(gap, se_gap)
            wins[a, u] += won
            spread = "" if math.isnan(se) else f" ± {se_gap:.2f}"
            text = f"{gap:+.2f}{spread} {metric.gap_unit}"
            judged[a, u] += not math.isnan(se)
            bytes_a, bytes_u = (_stat(runs.get(lv, []), "stored_bytes")[0] for lv in (a, u))
            verdict = "n/a" if math.isnan(se) else "better" if won else "tie" if ok else "**worse**"
            cells += [text, fmt_mean_std(bytes_a / bytes_u, 0.0, 2, "×"), verdict]
            met = "n/a" if math.isnan(se) else _yes_no(ok)
            checks.append(Check(f"{ex.title}: {a} no worse than {u}", text, "≥ −1 SE", met))
        for a in adaptive:
            recs = runs.get(a, [])
            count = _stat(recs, "adaptations")[0]
            cost = _stat(recs, "adaptation_overhead", 100.0)[0]
            if math.isnan(cost):
                cells.append("n/a")
                continue
            cells.append(f"{count:.1f}, {cost:.1f} %")
            met = _yes_no(cost <= budget)
            checks.append(Check(f"{ex.title}: {a} adaptation cost", f"{cost:.1f} %",
                                f"≤ {budget:g} %", met))  # fmt: skip
        lines.append(_row(cells))
    need = math.ceil(TARGETS["adaptive_wins"] * len(plan.examples))
    for (a, u), k in wins.items():
        met = _yes_no(k >= need) if judged[a, u] else "n/a"
        checks.append(Check(f"{a} better than {u} by more than 1 SE",
                            f"{k} of {len(plan.examples)} examples", f"≥ {need}", met))  # fmt: skip
    lines.append(
        "\nThe adaptive level's mean against the uniform level's, in the units of the fp32 gap "
        "(accuracy points: positive is better; % of the validation loss: negative is better), ± "
        "one standard error of the difference of the means over seeds. Verdict: better or worse "
        "by more than that, else a tie. L2 and L1 spend 4 bits per element, L2.2 and L1.2 2 bits, "
        "but the adaptive levels count metadata and masks inside that budget and the uniform "
        "ones on top of it; so `L2@L1` is L2 given the stored bytes of the same seed's L1 run as "
        "its memory budget (`--memory-budget`), and bytes is its stored bytes over L1's: the "
        "two then differ only in how the bytes are spread. Cost: mean number of adaptations "
        "per run of the adaptive level at its own settings and the time spent adapting over "
        "the time spent training (`stats()['adaptation_overhead']`).\n"
    )
    return lines, checks


def activation_table(plan: Plan, results: dict[str, Any]) -> tuple[list[str], list[Check]]:
    """Saved activations per step at fp32 and each level's compression ratio and stored bytes."""
    lines = ["### Saved activations per training step (from `controller.stats()`)\n"]
    lines += _header("example", plan.levels)
    checks = []
    for ex in plan.examples:
        runs = _runs(results, "train", ex)
        cells = [ex.title]
        for level in plan.levels:
            stored, _, n = _stat(runs.get(level, []), "stored_bytes", MIB)
            if level == BASELINE or n == 0:
                cells.append("n/a" if n == 0 else f"{stored:.2f} MiB")
                continue
            ratio, ratio_std, _ = _stat(runs[level], "compression_ratio")
            cells.append(f"{fmt_mean_std(ratio, ratio_std, 1, '×')} ({stored:.2f} MiB)")
            need = TARGETS.get(f"{level}_ratio")
            if need is not None:
                met = _yes_no(ratio >= need)
                checks.append(
                    Check(f"{ex.title}: {level} compression", f"{ratio:.1f}×", f"≥ {need:g}×", met)
                )
        lines.append(_row(cells))
    lines.append(
        "\nfp32: bytes autograd saved in a full training step of the fp32 (L0) run (the "
        "latest of the steps that saved the most: a partial last batch does not count). Other "
        "levels: compression ratio (original_bytes / stored_bytes of the same run's such step: "
        "the fp32 bytes of every distinct saved tensor over what GACT kept, per-group metadata "
        "included; integer tensors are kept and count on both sides) and the stored bytes.\n"
    )
    return lines, checks


def speed_table(plan: Plan, results: dict[str, Any]) -> list[str]:
    """Median step time and throughput of the training runs."""
    lines = ["### Median step time and throughput (training runs)\n"]
    lines += _header("example", plan.levels, "unit")
    for ex in plan.examples:
        runs = _runs(results, "train", ex)
        cells = [ex.title]
        for level in plan.levels:
            ms = _stat(runs.get(level, []), "step_time_s", 1e3)[0]
            rate = _stat(runs.get(level, []), "throughput")[0]
            cells.append("n/a" if math.isnan(ms) else f"{ms:.1f} ms ({rate:,.0f}/s)")
        units = [r.get("throughput_unit", "") for recs in runs.values() for r in recs]
        lines.append(_row([*cells, next(iter(units), "")]))
    lines.append(
        "\nStep time = forward + backward (+ compression, and the sensitivity probes on the steps "
        "where an adaptive level runs them; the median hides those). The CPU was shared with "
        "other jobs during the run, so step times are indicative only.\n"
    )
    return lines


def memory_table(plan: Plan, results: dict[str, Any]) -> tuple[list[str], list[Check]]:
    """Peak memory of the activation-dominated memory runs, and fp32 / L2 against its target."""
    examples = [ex for ex in plan.examples if _runs(results, "mem", ex)]
    if not examples:
        return [], []
    lines = ["### Peak memory, activation-dominated configurations (`--get-mem`, seed 0)\n"]
    lines += _header("example (config)", plan.own_levels, "fp32 / L2", "target")
    checks, need = [], TARGETS["peak_reduction"]
    for ex in examples:
        runs = _runs(results, "mem", ex)
        config = " ".join(ex.mem or ())
        cells = [f"{ex.title} (`{config}`)"]
        for level in plan.own_levels:
            r = _first(runs, level)
            live = None if r is None else r.get("live_peak_bytes")
            cells.append(
                "n/a"
                if r is None
                else f"+{r['peak_memory_delta_bytes'] * MIB:.0f} MiB"
                + ("" if live is None else f", live {live * MIB:.0f} MiB")
                + f" (saved {r['stored_bytes'] * MIB:.0f} MiB)"
            )
        fp32, l2 = _first(runs, BASELINE), _first(runs, "L2")
        reduction = (
            fp32["peak_memory_delta_bytes"] / max(1, l2["peak_memory_delta_bytes"])
            if fp32 and l2
            else math.nan
        )
        met = "n/a" if math.isnan(reduction) else _yes_no(reduction >= need)
        measured = f"{reduction:.2f}×"
        if fp32 and l2 and fp32.get("live_peak_bytes") and l2.get("live_peak_bytes"):
            measured += f" (live {fp32['live_peak_bytes'] / l2['live_peak_bytes']:.2f}×)"
        checks.append(
            Check(f"{ex.title}: peak memory fp32/L2 ({config})", measured, f"≥ {need:g}×", met)
        )
        lines.append(_row([*cells, measured, f"≥ {need:g}×"]))
    method = next(
        (
            recs[0].get("memory_method")
            for per in results["mem"].values()
            for recs in per.values()
            if recs
        ),
        "",
    )
    lines.append(
        f"\nPeak = {method}, minus the resident size just before training (data, model, "
        "interpreter), under the C allocator the run had (glibc's default unless the method "
        "names a tuning); live = the peak of live tensor bytes in one step after the warm-up "
        "(the torch profiler's allocation events, independent of the allocator; CPU runs). "
        "Peak memory falls much less than saved activations: weights, gradients, "
        "optimizer state and the backward pass's working set are not compressed. Only the "
        "configurations here are activation-dominated; the training runs' peaks are in the JSON "
        "records.\n"
    )
    return lines, checks


def max_batch_table(plan: Plan, results: dict[str, Any]) -> list[str]:
    """Largest batch that fits per level (GPU only)."""
    if not results["max_batch"]:
        return [
            "Max-batch search (binary search in subprocesses until CUDA OOM) runs only on a GPU; "
            "this run had none.\n"
        ]
    lines = ["### Largest batch that fits (GPU, binary search until OOM)\n"]
    lines += _header("example", plan.own_levels)
    titles = {ex.name: ex.title for ex in plan.examples}
    for name, per_level in results["max_batch"].items():
        cells = (str(per_level.get(lv, "n/a")) for lv in plan.own_levels)
        lines.append(_row([titles.get(name, name), *cells]))
    return [*lines, ""]


def _targets_table(checks: Sequence[Check]) -> list[str]:
    lines = ["### Targets\n", "| check | measured | target | met |", "|---|---|---|---|"]
    lines += [_row([c.name, c.measured, c.target, c.met]) for c in checks]
    return [*lines, ""]


def _bench_command(plan: Plan) -> str:
    quick = ["--quick"] if plan.quick else []
    return shlex.join(
        ["python", "examples/bench.py", "--data", "DATA", *quick, "--seeds", str(plan.seeds)]
    )


def _commands(plan: Plan) -> list[str]:
    lines = [
        "### Commands\n",
        f"Each cell above is one run of (LEVEL ∈ {', '.join(plan.levels)}; "
        f"SEED ∈ 0..{plan.seeds - 1}; LEVEL A@U is `--level A --memory-budget B`, B being the "
        "`stored_bytes` of the same example and seed's run at U):\n",
        "```",
        *(command_template(ex, plan, "train") for ex in plan.examples),
    ]
    if plan.memory:
        lines += [command_template(ex, plan, "mem") for ex in plan.examples if ex.mem]
    lines += [
        "```\n",
        f'Whole benchmark: `{_bench_command(plan)}` (or `nox -s "bench(examples)"`). Plots: '
        "`plots/examples_metric.png`, `plots/examples_memory.png`.\n",
    ]
    return lines


def _intro(plan: Plan, results: dict[str, Any], machine: dict[str, Any]) -> list[str]:
    if results["wall_s"] is not None:
        wall = f"wall time {results['wall_s'] / 60:.1f} min"
    else:
        recs = [
            r
            for kind in ("train", "mem")
            for per in results[kind].values()
            for rs in per.values()
            for r in rs
        ]
        minutes = sum(r.get("train_time_s") or 0 for r in recs) / 60
        wall = (
            f"report regenerated from saved records; their training time sums to {minutes:.1f} min"
        )
    lines = [
        "## Examples: accuracy, activation memory and speed per GACT level\n",
        f"Generated by `{_bench_command(plan)}` on {time.strftime('%Y-%m-%d %H:%M %Z')} ({wall}). "
        f"Numbers are mean ± std over {plan.seeds} seed(s) unless marked (n=). fp32 = level L0: "
        "GACT's hooks are installed and count every saved tensor but store it unchanged, so saved "
        "activations are measured by the same code at every level.\n",
        "**Machine**: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + "\n",
    ]
    if results.get("missing"):
        lines.append(
            f"**Not run** ({len(results['missing'])} of the planned runs; the benchmark was "
            "stopped before them, tables use the completed seeds, n shown where fewer): "
            + "; ".join(results["missing"])
            + "\n"
        )
    if results["failures"]:
        lines.append(
            "**Failed runs** (excluded from the tables): " + "; ".join(results["failures"]) + "\n"
        )
    return lines


def render(plan: Plan, results: dict[str, Any], machine: dict[str, Any]) -> str:
    """The whole examples section, between :data:`BEGIN` and :data:`END`."""
    metric_lines, metric_checks = metric_table(plan, results)
    adaptive_lines, adaptive_checks = adaptive_table(plan, results)
    activation_lines, activation_checks = activation_table(plan, results)
    memory_lines, memory_checks = memory_table(plan, results)
    checks = [*metric_checks, *adaptive_checks, *activation_checks, *memory_checks]
    lines = [
        BEGIN,
        *_intro(plan, results, machine),
        *metric_lines,
        *adaptive_lines,
        *activation_lines,
        *speed_table(plan, results),
        *memory_lines,
        *max_batch_table(plan, results),
        *_targets_table(checks),
        *_commands(plan),
        END,
    ]
    return "\n".join(lines)


def write_markdown(path: Path, section: str) -> None:
    """Put ``section`` between the markers of ``path`` (appended when they are missing)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        text = before + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
