"""Step time of real models, fp32 against every GACT level, interleaved in one process.

Per model (``gact_examples.workloads``: transformers GPT-2 and BERT from configs, the ResNet-18
layout, the char-GPT and MNIST memory configurations, a GCN on Cora, on real data) the script builds one copy
per level from the same initial weights and trains them in rounds: each round runs ``--steps``
steps of every level in turn (the order rotates between rounds), so that a slow phase of this
shared machine hits every level alike. A level's ratio is its median step time over fp32's
median *in the same round*; the table shows the median ratio over rounds and the worst one.
With ``--compile BACKEND`` every copy, fp32's included, is compiled in place
(``nn.Module.compile``; the first round's first step compiles and is not timed).

    python examples/speed_bench.py --data ../shared/data --json speed_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from gact import Controller, GactConfig
from gact_examples.workloads import parse_models, workload

LEVELS = ("fp32", "L0", "L1", "L2", "L1.2", "L2.2")


def measure(
    name: str, data: str, levels: Sequence[str], rounds: int, steps: int, backend: str | None
) -> dict:
    """Per level: the step times of every round (seconds) and the ratios to fp32's."""
    runs = {}
    for level in levels:
        torch.manual_seed(0)
        work = workload(name, data)
        if backend is not None:
            work.model.compile(backend=backend)
        ctl = None if level == "fp32" else Controller(work.model, GactConfig.from_level(level))
        runs[level] = (work, ctl)
    times: dict[str, list[list[float]]] = {level: [] for level in levels}
    for r in range(rounds):
        order = [*levels[r % len(levels) :], *levels[: r % len(levels)]]
        for level in order:
            work, ctl = runs[level]
            if ctl is not None:
                ctl.install_hook()
            spent = []
            for i in range(steps + 1):  # the first step of a round warms the caches up
                start = time.perf_counter()
                loss = work.loss(r * (steps + 1) + i)
                work.optimizer.zero_grad()
                loss.backward()
                work.optimizer.step()
                if ctl is not None:
                    ctl.step()
                if i:
                    spent.append(time.perf_counter() - start)
            if ctl is not None:
                ctl.uninstall_hook()
            times[level].append(spent)
    result: dict[str, Any] = {"model": name, "backend": backend, "levels": {}}
    for level in levels:
        ratios = [
            statistics.median(times[level][r]) / statistics.median(times["fp32"][r])
            for r in range(rounds)
        ]
        result["levels"][level] = {
            "step_s": statistics.median(t for round_ in times[level] for t in round_),
            "ratio_median": statistics.median(ratios),
            "ratio_worst": max(ratios),
            "ratios": ratios,
        }
    return result


def table(results: list[dict]) -> str:
    levels = list(results[0]["levels"]) if results else []
    head = "| model | " + " | ".join(levels) + " |"
    lines = [head, "|---|" + "---|" * len(levels)]
    for res in results:
        cells = []
        for level in levels:
            row = res["levels"][level]
            if level == "fp32":
                cells.append(f"{1e3 * row['step_s']:.0f} ms")
            else:
                cells.append(f"{row['ratio_median']:.2f}x (worst {row['ratio_worst']:.2f}x)")
        lines.append(f"| {res['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--models", default="bert,gpt2,resnet18")
    p.add_argument("--levels", default=",".join(LEVELS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per level and round")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--compile", default=None, help="torch.compile backend for every copy")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    models = parse_models(args.models)
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    if "fp32" not in levels:
        levels.insert(0, "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for name in models:
        results.append(measure(name, args.data, levels, args.rounds, args.steps, args.compile))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if args.json:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "rounds": args.rounds, "steps": args.steps, "compile": args.compile}  # fmt: skip
        Path(args.json).write_text(json.dumps({**meta, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
