"""Cost of GACT's runtime on a small CNN: step time per level and the adaptation overhead.

A probing adaptation runs ``1 + K`` extra forward/backward passes (pairwise estimator,
K ~ sqrt(2L)). L2 runs here with probes forced from step 1 on (``adapt_first_gap=1`` and no time
budget; the default schedule waits until an adaptation costs at most 5% of the training time so
far, which a 30-step run never reaches), so that the cost of one adaptation is measured; the
script reports it, the median step time, and the overhead one adaptation per ``n`` steps would
amortise to, for the ``--intervals`` given.

    python packages/gact-runtime/benchmarks/bench_adapt.py [--steps 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from gact import Controller, GactConfig
from torch import nn


def make_model() -> nn.Module:
    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, 32, 1), *block(32, 32, 1), *block(32, 64, 2), *block(64, 64, 1),
        *block(64, 128, 2), *block(128, 128, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, 10),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--intervals", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    rows = {}
    for level in ("L0", "L1", "L2"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def closure(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> torch.Tensor:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            return loss

        times = []
        forced = dict(adapt_first_gap=1, adapt_budget=None) if level == "L2" else {}
        with Controller(model, GactConfig.from_level(level, **forced)) as ctl:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                ctl.iterate(closure)
                opt.step()
                times.append(time.perf_counter() - t0)
            stats = ctl.stats()
        step = statistics.median(times[1:])
        count = ctl.adapter.count
        adapt = ctl.adapter.seconds / count if count else 0.0  # one adaptation
        rows[level] = {
            "median_step_s": step,
            "ratio": stats["ratio"],
            "adaptations": count,
            "adaptation_s": adapt,
            "tensors": stats["compressed_tensors"],
            **{
                f"overhead_at_{n}": adapt / (adapt + n * step) if adapt else 0.0
                for n in args.intervals
            },
        }
    base = rows["L0"]["median_step_s"]
    print(f"{'level':6} {'step ms':>8} {'vs L0':>6} {'ratio':>6} {'adapt s':>8} "
          + " ".join(f"{'ovh@' + str(n):>9}" for n in args.intervals))  # fmt: skip
    for level, r in rows.items():
        print(
            f"{level:6} {1e3 * r['median_step_s']:8.1f} {r['median_step_s'] / base:6.2f} "
            f"{r['ratio']:6.2f} {r['adaptation_s']:8.2f} "
            + " ".join(f"{100 * r[f'overhead_at_{n}']:8.2f}%" for n in args.intervals)
        )
    out = {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
           "batch": args.batch, "rows": rows}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
