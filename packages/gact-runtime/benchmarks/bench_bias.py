"""Is the gradient unbiased? The first layer's weight gradient, averaged over rounding seeds.

``Linear(32, 256) - activation - Linear(256, 8)`` at a fixed-bit level: the first layer's weight
gradient passes the activation's backward and is linear in the compressed input, so its mean over
seeds must be the fp32 gradient. Printed per activation: the relative bias of the mean
``|mean - exact| / |exact|`` (its noise floor, with ``S`` seeds, is about the relative standard
error of the mean: Tanh's row shows it) and the fraction of elements whose mean lies beyond 6
standard errors of the exact value (expected 0).

    python packages/gact-runtime/benchmarks/bench_bias.py [--seeds 120] [--level L1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

import torch
from gact import LEVELS, Controller, GactConfig
from torch import nn

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "ReLU": nn.ReLU,
    "LeakyReLU(0.1)": lambda: nn.LeakyReLU(0.1),
    "Tanh": nn.Tanh,
}


def measure(make_act: Callable[[], nn.Module], level: str, seeds: int) -> dict[str, float]:
    """Relative bias of the mean and the fraction of elements beyond 6 standard errors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), make_act(), nn.Linear(256, 8))
    x, c = torch.randn(128, 32), torch.randn(128, 8)

    def closure() -> None:
        model.zero_grad()
        (model(x) * c).sum().backward()

    closure()
    exact = model[0].weight.grad.double()
    samples = []
    for seed in range(seeds):
        with Controller(model, GactConfig.from_level(level, min_numel=0, seed=seed)) as ctl:
            ctl.iterate(closure)
        samples.append(model[0].weight.grad.double())
    stack = torch.stack(samples)
    mean, stderr = stack.mean(0), stack.std(0) / math.sqrt(seeds)
    return {
        "relative_bias": float((mean - exact).norm() / exact.norm()),
        "beyond_6_se": float(((mean - exact).abs() > 6 * stderr).double().mean()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=120)
    p.add_argument("--level", default="L1", choices=[k for k, v in LEVELS.items() if v.bits])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {name: measure(act, args.level, args.seeds) for name, act in ACTIVATIONS.items()}
    print(f"| activation ({args.level}, {args.seeds} seeds) | relative bias | beyond 6 SE |")
    print("|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['relative_bias']:.3f} | {r['beyond_6_se']:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"level": args.level, "seeds": args.seeds, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
