"""What rotated groups buy and cost on the LLaMA-style decoder (NOTE [Rotated groups] in
gact/rotation.py): after ``--warmup`` fp32 training steps (heavy tails grow with training),

- which saves an L1 step rotates;
- per linear layer, the rounding error of its weight gradient at L1 (squared, summed over
  ``--draws`` rounding seeds of one batch, relative to the exact gradient's squared norm), with
  rotation and without (``GactConfig(rotated_groups=False)``);
- the step time of fp32, L1 without and L1 with rotation, interleaved in one process (median
  of ``--rounds`` rounds of ``--steps`` steps, the worst round beside it).

    python examples/rotation_bench.py --data DATA --device cpu --json rotation.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from gact import Controller, GactConfig
from gact.saved import SavedCompressed
from gact_examples.tasks import make_task, warmed_up
from torch import nn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gradient_errors(model: nn.Module, task: Any, batch: Any, draws: int) -> list[dict[str, Any]]:
    """Per linear layer, its weight gradient's squared rounding error at L1 over ``draws``
    seeds, relative to the exact gradient's squared norm, rotated and plain."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}

    def grads(config: GactConfig | None) -> dict[str, torch.Tensor]:
        model.zero_grad()
        with Controller(model, config) if config is not None else contextlib.nullcontext():
            task.loss(model, batch).backward()
        return {n: m.weight.grad.detach().clone() for n, m in linears.items()}

    exact = grads(None)
    rows = []
    totals = {"rotated": dict.fromkeys(exact, 0.0), "plain": dict.fromkeys(exact, 0.0)}
    for seed in range(draws):
        for name, rotated in (("rotated", True), ("plain", False)):
            got = grads(GactConfig.from_level("L1", seed=seed, rotated_groups=rotated))
            for n in exact:
                totals[name][n] += float((got[n] - exact[n]).pow(2).sum())
    for n, g in exact.items():
        norm = float(g.pow(2).sum()) * draws
        rows.append(
            {"layer": n, "rotated": totals["rotated"][n] / norm, "plain": totals["plain"][n] / norm}
        )
    return rows


def rotated_saves(model: nn.Module, task: Any, batch: Any) -> list[list[int]]:
    """The shapes of the saves one L1 step rotates."""
    controller = Controller(model, GactConfig.from_level("L1"))
    saves: list[Any] = []
    pack = controller.hooks.pack_own

    def recording(tensor: torch.Tensor, **kwargs: Any) -> Any:
        saves.append(pack(tensor, **kwargs))
        return saves[-1]

    controller.hooks.pack_own = recording
    with controller:
        task.loss(model, batch).backward()
    return [list(s.known.shape) for s in saves if isinstance(s, SavedCompressed) and s.rotated]


def step_times(
    model: nn.Module, task: Any, batches: Any, rounds: int, steps: int, device: torch.device
) -> dict[str, list[float]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    variants = {
        "fp32": None,
        "L1 plain": Controller(model, GactConfig.from_level("L1", rotated_groups=False)),
        "L1 rotated": Controller(model, GactConfig.from_level("L1")),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds + 1):  # round 0 warms up
        for name, controller in variants.items():
            with controller if controller is not None else contextlib.nullcontext():
                _sync(device)
                start = time.perf_counter()
                for _ in range(steps):
                    optimizer.zero_grad()
                    task.loss(model, next(batches)).backward()
                    optimizer.step()
                    if controller is not None:
                        controller.step()
                _sync(device)
                if r:
                    times[name].append((time.perf_counter() - start) / steps)
    return times


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--warmup", type=int, default=300, help="fp32 training steps first")
    p.add_argument("--draws", type=int, default=8)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    task = make_task("llama", argparse.Namespace(data=args.data, batch_size=args.batch_size))
    model, batches = warmed_up(task, args.warmup, device)
    batch = next(batches)
    result: dict[str, Any] = {"device": str(device), "warmup": args.warmup}
    result["rotated_saves"] = rotated_saves(model, task, batch)
    result["errors"] = gradient_errors(model, task, batch, args.draws)
    times = step_times(model, task, batches, args.rounds, args.steps, device)
    fp32 = times["fp32"]
    result["step"] = {
        name: {
            "median_ms": 1e3 * statistics.median(t),
            "vs_fp32": statistics.median(a / b for a, b in zip(t, fp32)),
            "worst_vs_fp32": max(a / b for a, b in zip(t, fp32)),
        }
        for name, t in times.items()
    }
    print(f"rotated saves of an L1 step after {args.warmup} fp32 steps: {result['rotated_saves']}")
    print("| linear layer | weight-gradient error, plain | rotated | rotated / plain |")
    print("|---|---:|---:|---:|")
    for row in result["errors"]:
        ratio = row["rotated"] / row["plain"]
        print(f"| {row['layer']} | {row['plain']:.2e} | {row['rotated']:.2e} | {ratio:.2f} |")
    print(f"| variant ({device}) | step | vs fp32 (worst round) |")
    print("|---|---:|---:|")
    for name, s in result["step"].items():
        print(
            f"| {name} | {s['median_ms']:.1f} ms | {s['vs_fp32']:.3f}x ({s['worst_vs_fp32']:.3f}x) |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
