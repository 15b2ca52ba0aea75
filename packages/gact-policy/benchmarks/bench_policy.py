"""Benchmark of gact_policy: allocation time and the cheap estimator's accuracy.

Usage: ``python bench_policy.py [--json FILE] [--repeat N]``. Prints two tables:

1. ``allocate_bits`` wall time (median of ``N`` runs) for 100 / 1,000 / 10,000 items with
   log-normal sensitivities, sizes 1e3..1e6, 3 bits per element and 64/256 bits of overhead,
   for ``method="exact"`` and ``"greedy"``, and the exact optimum's variance gain over greedy.
2. Median relative error against the true closed-form ``c`` of a synthetic linear model, for the
   reference estimator (``1 + L`` evaluations) and the pairwise estimator at several probe counts,
   plus the pairwise estimator's error against the reference estimate.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from gact_policy import (
    LinearNoiseModel,
    allocate_bits,
    min_pair_probes,
    pairwise_sensitivity,
    predicted_variance,
    probe_sensitivity,
)


def bench_allocation(repeat: int) -> list[dict]:
    rows = []
    for n_items in (100, 1_000, 10_000):
        rng = np.random.default_rng(n_items)
        c = rng.lognormal(sigma=2.0, size=n_items)
        numel = rng.integers(1_000, 1_000_000, size=n_items)
        result = {}
        for method in ("exact", "greedy"):
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                bits = allocate_bits(c, numel, 3.0, method=method, overhead_bits=0.25)
                times.append(time.perf_counter() - start)
            result[method] = (float(np.median(times)) * 1e3, predicted_variance(c, bits))
        gain = 1.0 - result["exact"][1] / result["greedy"][1]
        rows.append(
            {
                "items": n_items,
                "exact_ms": result["exact"][0],
                "greedy_ms": result["greedy"][0],
                "exact_variance_gain": gain,
            }
        )
    return rows


def bench_estimators(n_items: int = 60, dim: int = 4096, seeds: int = 3) -> list[dict]:
    model = LinearNoiseModel.random(n_items, dim, seed=0, spread=1.0)
    true = model.sensitivity
    bits = np.full(n_items, 2)

    def err(est: np.ndarray, ref: np.ndarray) -> float:
        return float(np.median(np.abs(est / ref - 1.0)))

    refs = [probe_sensitivity(model, bits, seed=s) for s in range(seeds)]
    rows = [
        {
            "estimator": "reference",
            "evaluations": 1 + n_items,
            "err_vs_true": float(np.mean([err(r, true) for r in refs])),
            "err_vs_reference": 0.0,
        }
    ]
    for k in sorted({min_pair_probes(n_items), 16, 24, 32, 48, 64, 96}):
        ests = [pairwise_sensitivity(model, bits, num_probes=k, seed=s) for s in range(seeds)]
        rows.append(
            {
                "estimator": f"pairwise K={k}",
                "evaluations": 1 + k,
                "err_vs_true": float(np.mean([err(e, true) for e in ests])),
                "err_vs_reference": float(np.mean([err(e, r) for e, r in zip(ests, refs)])),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--repeat", type=int, default=15, help="timing repetitions")
    args = parser.parse_args()
    alloc = bench_allocation(args.repeat)
    print("allocate_bits (3 bits/elem, overhead 0.25): median wall time, target < 10 ms")
    print(f"{'items':>8} {'exact ms':>10} {'greedy ms':>10} {'exact gain':>11}")
    for r in alloc:
        print(
            f"{r['items']:>8} {r['exact_ms']:>10.2f} {r['greedy_ms']:>10.2f} "
            f"{r['exact_variance_gain']:>11.2e}"
        )
    est = bench_estimators()
    print("\nsensitivity estimators (L=60, D=4096, 2-bit probes): median relative error")
    print(f"{'estimator':>16} {'evals':>6} {'vs true':>8} {'vs ref':>8}")
    for r in est:
        print(
            f"{r['estimator']:>16} {r['evaluations']:>6} {r['err_vs_true']:>8.3f} "
            f"{r['err_vs_reference']:>8.3f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"allocation": alloc, "estimators": est}, fh, indent=2)


if __name__ == "__main__":
    main()
