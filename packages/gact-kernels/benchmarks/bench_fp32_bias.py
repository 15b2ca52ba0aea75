"""Exact bias of the float32 round trip: E[dequantize(quantize(x))] - x, without sampling.

float32 outputs keep the level ``lo + q * scale`` rounded to nearest (float16/bfloat16 outputs
round it stochastically and are unbiased exactly; see NOTE [storage and RNG invariants]). The
remaining bias comes from fp32 arithmetic: ``x - lo``, the division by ``scale``, the addition
of the 24-bit noise u, the clamp to ``2^b - 1`` and the level's own rounding. For a sample of
elements this script enumerates all 2^24 values of u with the kernels' operations (numpy
float32, round to nearest), so the expectation is exact, and reports the worst bias per width
and kind of group in units of the fp32 ulp of the group's largest magnitude M (and of x).

Usage:
    python packages/gact-kernels/benchmarks/bench_fp32_bias.py [--json bias.json]
"""

from __future__ import annotations

import argparse
import json

import gact_kernels
import numpy as np
import torch

F32 = np.float32
FMAX = np.finfo(np.float32).max
GROUP = 64

KINDS = {
    "uniform[0,2)": lambda rng: rng.uniform(0, 2, GROUP),
    "uniform[-3,5)": lambda rng: rng.uniform(-3, 5, GROUP),
    "narrow 512+8ulp": lambda rng: 512 + np.spacing(F32(512)) * rng.integers(0, 9, GROUP),
    "near max": lambda rng: rng.uniform(1e38, 3.4e38, GROUP),
    "around 0 (+-1e-3)": lambda rng: rng.uniform(-1e-3, 1e-3, GROUP),
}


def exact_mean(x: np.float32, lo: np.float32, scale: np.float32, levels: int) -> float:
    """E over all 2^24 noise values of the restored float32 value of x."""
    u = np.arange(2**24, dtype=np.float32) * F32(2.0**-24)
    t = np.minimum(F32(F32(x - lo) / scale) + u, F32(levels))
    q = t.astype(np.int64)
    counts = np.bincount(q - q.min())
    codes = np.arange(q.min(), q.min() + len(counts)).astype(np.float32)
    level = np.clip((lo + codes * scale).astype(np.float32), -FMAX, FMAX)
    return float(np.dot(counts.astype(np.float64), level.astype(np.float64)) / 2**24)


def measure(bits: int, kind: str, per_group: int, rng: np.random.Generator) -> dict[str, object]:
    x = KINDS[kind](rng).astype(np.float32)
    q = gact_kernels.quantize(torch.from_numpy(x), bits, group_size=GROUP)
    lo, scale = F32(q.lo[0].item()), F32(q.scale[0].item())
    ulp_m = float(np.spacing(F32(np.abs(x).max())))
    worst_m = worst_x = 0.0
    for xi in x[:per_group]:
        bias = abs(exact_mean(xi, lo, scale, 2**bits - 1) - float(xi))
        worst_m = max(worst_m, bias / ulp_m)
        worst_x = max(worst_x, bias / float(np.spacing(np.abs(xi))))
    return {"bits": bits, "kind": kind, "max_ulp_of_M": worst_m, "max_ulp_of_x": worst_x}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--per-group", type=int, default=8, help="elements measured per group")
    parser.add_argument("--bits", type=int, nargs="+", default=list(range(1, 9)))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'bits':>4} {'group':20} {'max |bias| / ulp(M)':>20} {'max |bias| / ulp(x)':>20}")
    rows = []
    for bits in args.bits:
        for kind in KINDS:
            rows.append(measure(bits, kind, args.per_group, rng))
            r = rows[-1]
            print(f"{bits:>4} {kind:20} {r['max_ulp_of_M']:20.3f} {r['max_ulp_of_x']:20.3f}")
    print(f"worst: {max(r['max_ulp_of_M'] for r in rows):.3f} ulp of the group's max |x|")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
