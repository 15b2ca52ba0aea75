"""What GACT's runtime costs per saved tensor, beyond its kernels.

A stack of ``depth`` x (Linear(w, w) + GELU) on a batch of ``b`` rows saves two activations of
``b * w`` elements per layer (the GELU input and the Linear input) and one weight. Per level
(fp32 without GACT, L0 = hooks that only account, L1 = 4 bits, L2 = adaptive 4 bits on average)
the script times training steps, interleaved across levels in rounds so that a slow phase of
the machine hits every level alike, and reports per activation save

- ``us/save``: (median step time - fp32's) / activation saves per step;
- ``kernel``: quantize + dequantize of one such activation at 4 bits (timed alone);
- ``beyond``: ``us/save - kernel`` (for L0, all of it): the Python and allocator cost of a save.

Sizes: 2,048 elements (100 layers, 32 x 64), 65,536 (24 layers, 256 x 256) and 1,048,576
(4 layers, 1024 x 1024). One thread by default: the per-save cost is serial Python.

    python packages/gact-runtime/benchmarks/bench_saves.py --json saves.json   # = nox -s "bench(runtime)"
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import gact_kernels
import torch
from gact import Controller, GactConfig
from torch import nn

LEVELS = ("fp32", "L0", "L1", "L2")
#: (elements per activation, depth, batch, width)
SIZES = ((2048, 100, 32, 64), (65536, 24, 256, 256), (1 << 20, 4, 1024, 1024))


def _stack(depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])


def _kernel_us(x: torch.Tensor, repeat: int) -> float:
    """Median microseconds of a 4-bit quantize + dequantize of ``x``."""
    times = []
    for i in range(repeat):
        start = time.perf_counter()
        gact_kernels.dequantize(gact_kernels.quantize(x, 4, seed=i))
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def measure(numel: int, depth: int, batch: int, width: int, rounds: int, steps: int) -> dict:
    """Median step time per level over ``rounds`` interleaved rounds of ``steps`` steps."""
    x = torch.randn(batch, width)
    runs = {}
    for level in LEVELS:
        model = _stack(depth, width)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        ctl = None if level == "fp32" else Controller(model, GactConfig.from_level(level))
        runs[level] = (model, opt, ctl, [])
    for r in range(rounds):
        order = LEVELS[r % len(LEVELS) :] + LEVELS[: r % len(LEVELS)]
        for level in order:
            model, opt, ctl, times = runs[level]
            if ctl is not None:
                ctl.install_hook()
            for i in range(steps + 1):  # the first step of a round warms the caches up
                start = time.perf_counter()
                loss = model(x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if ctl is not None:
                    ctl.step()
                if i:
                    times.append(time.perf_counter() - start)
            if ctl is not None:
                ctl.uninstall_hook()
    saves = 2 * depth  # activation saves per step (the GELU input and the Linear input)
    step = {level: statistics.median(runs[level][3]) for level in LEVELS}
    kernel = _kernel_us(torch.randn(batch, width), repeat=max(20, 2000 // depth))
    rows = {}
    for level in LEVELS:
        per_save = 1e6 * (step[level] - step["fp32"]) / saves
        rows[level] = {
            "step_ms": 1e3 * step[level],
            "vs_fp32": step[level] / step["fp32"],
            "us_per_save": per_save if level != "fp32" else 0.0,
            "beyond_kernel_us": (per_save - (kernel if level in ("L1", "L2") else 0.0))
            if level != "fp32"
            else 0.0,
        }
    return {"numel": numel, "depth": depth, "batch": batch, "width": width, "kernel_us": kernel,
            "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="timed steps per level and round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sizes", default=",".join(str(s[0]) for s in SIZES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    wanted = {int(s) for s in args.sizes.split(",")}
    results = [measure(*size, args.rounds, args.steps) for size in SIZES if size[0] in wanted]
    print(f"{'elements':>9} {'level':5} {'step ms':>8} {'vs fp32':>7} {'us/save':>8} "
          f"{'kernel':>7} {'beyond':>7}")  # fmt: skip
    for res in results:
        for level, row in res["rows"].items():
            kernel = f"{res['kernel_us']:7.1f}" if level in ("L1", "L2") else f"{'-':>7}"
            print(
                f"{res['numel']:9d} {level:5} {row['step_ms']:8.2f} {row['vs_fp32']:7.2f} "
                f"{row['us_per_save']:8.1f} {kernel} {row['beyond_kernel_us']:7.1f}"
            )
    if args.json:
        meta = {"torch": torch.__version__, "threads": args.threads, "rounds": args.rounds}
        with open(args.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
