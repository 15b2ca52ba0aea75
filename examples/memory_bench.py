"""The memory a user's process feels: peak resident-set growth and step time of real models,
fp32 against GACT levels, under the C allocator the process runs with.

Each (model, level, allocator) runs in a fresh process: it builds the model, then trains
``--steps`` steps on real data, and reports the growth of the peak resident set (VmHWM) over the
resident size before the first step (weights, data and the interpreter are the baseline; the
optimizer state, the working set and what autograd saves are the growth), the median step time
after the first step, and what GACT saved and stored per step. Allocators:

- ``default``: glibc's malloc as every process starts with it (what users run);
- ``glibc-tuned``: ``MALLOC_MMAP_THRESHOLD_=131072`` and ``MALLOC_TRIM_THRESHOLD_=131072`` in the
  child's environment, so that freed blocks of 128 KiB and more leave the process (what the
  examples' ``--get-mem`` runs set with ``mallopt``);
- ``tcmalloc``, ``jemalloc``: the library preloaded with ``LD_PRELOAD`` (skipped when its shared
  object is not found; Debian's ``libtcmalloc-minimal4`` and ``libjemalloc2``).

Models: ``gact_examples.workloads.MODELS`` (GPT-2 and BERT from ``transformers`` configs, the
ResNet-18 layout, the char-GPT and MNIST examples' memory configurations, on real data). With
``--compile BACKEND`` each process compiles its model in place (``nn.Module.compile``; with
``BACKEND/blocks`` each of its blocks alone) before the controller sees it; compile's own
memory is then in every level's peak, the first step compiles.

    python examples/memory_bench.py --data ../shared/data --json memory_bench.json \\
        --plot plots/memory_bench.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gact_examples.memory import status_bytes
from gact_examples.runs import publish
from gact_examples.workloads import MODELS, workload

LEVELS = ("L0", "L1", "L2", "L1.2", "L2.2")
PRELOADS = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
}
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def allocator_env(name: str) -> dict[str, str] | None:
    """Environment variables that select ``name`` in a child process; None if unavailable."""
    if name == "default":
        return {}
    if name == "glibc-tuned":
        return {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    for lib in PRELOADS[name]:
        for folder in LIB_DIRS:
            path = Path(folder) / lib
            if path.exists():
                return {"LD_PRELOAD": str(path)}
    return None


def worker(
    model_name: str, level: str, steps: int, data: str, backend: str | None = None
) -> dict[str, Any]:
    """One run in this process (see the module docstring)."""
    import torch
    from gact import Controller, GactConfig

    torch.manual_seed(0)
    work = workload(model_name, data)
    if backend is not None:
        work.compile(backend)
    controller = Controller(work.model, GactConfig.from_level(level))
    baseline = status_bytes("VmRSS")
    times = []
    with controller:
        for i in range(steps):

            def closure(i: int = i) -> torch.Tensor:
                loss = work.loss(i)
                work.optimizer.zero_grad()
                loss.backward()
                return loss

            start = time.perf_counter()
            controller.iterate(closure)
            work.optimizer.step()
            times.append(time.perf_counter() - start)
    stats = controller.stats()
    return {
        "model": model_name,
        "level": level,
        "compile": backend,
        "steps": steps,
        "baseline_bytes": baseline,
        "peak_growth_bytes": status_bytes("VmHWM") - baseline,
        "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "saved_bytes": stats["original_bytes"],
        "stored_bytes": stats["stored_bytes"],
    }


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    records = []
    for allocator in args.allocators.split(","):
        env = allocator_env(allocator)
        if env is None:
            print(f"{allocator}: not found, skipped", file=sys.stderr)
            continue
        for model in args.models.split(","):
            for level in args.levels.split(","):
                cmd = [sys.executable, __file__, "--worker", model, level, "--data", args.data]
                cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
                cmd += [] if args.compile is None else ["--compile", args.compile]
                proc = subprocess.run(
                    cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False
                )
                if proc.returncode:
                    raise RuntimeError(
                        f"{model} {level} {allocator} failed:\n{proc.stderr[-3000:]}"
                    )
                rec = {**json.loads(proc.stdout.strip().splitlines()[-1]), "allocator": allocator}
                records.append(rec)
                print(
                    f"{allocator:11s} {model:9s} {level:5s} peak +{rec['peak_growth_bytes'] / 2**20:6.0f}"
                    f" MiB, step {1e3 * rec['step_s']:6.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    return records


def table(records: list[dict[str, Any]]) -> str:
    """Peak growth (and its ratio to fp32's) and step time (ratio to fp32's), per allocator and
    model, levels as columns."""
    levels = [lv for lv in LEVELS if any(r["level"] == lv for r in records)]
    lines = [
        "| allocator | model (saved per step at fp32) | "
        + " | ".join("fp32" if lv == "L0" else lv for lv in levels)
        + " |",
        "|---|---|" + "---|" * len(levels),
    ]
    keys = sorted(
        {(r["allocator"], r["model"]) for r in records}, key=lambda k: (k[0], MODELS.index(k[1]))
    )
    for allocator, model in keys:
        runs = {
            r["level"]: r for r in records if (r["allocator"], r["model"]) == (allocator, model)
        }
        base = runs.get("L0")
        cells = []
        for lv in levels:
            r = runs.get(lv)
            if r is None:
                cells.append("")
                continue
            mib = r["peak_growth_bytes"] / 2**20
            cell = f"+{mib:.0f} MiB, {1e3 * r['step_s']:.0f} ms"
            if base is not None and lv != "L0":
                gain = base["peak_growth_bytes"] / max(r["peak_growth_bytes"], 1)
                cell += f" ({gain:.2f}x less, {r['step_s'] / base['step_s']:.2f}x time)"
            cells.append(cell)
        saved = f"{base['saved_bytes'] / 2**20:.0f} MiB" if base else "?"
        lines.append(f"| {allocator} | {model} ({saved}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    allocators = list(dict.fromkeys(r["allocator"] for r in records))
    models = [m for m in MODELS if any(r["model"] == m for r in records)]
    levels = [lv for lv in LEVELS if any(r["level"] == lv for r in records)]
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 3.4), squeeze=False)
    width = 0.8 / len(allocators)
    for ax, model in zip(axes[0], models):
        for i, allocator in enumerate(allocators):
            values = [
                next(
                    (
                        r["peak_growth_bytes"] / 2**20
                        for r in records
                        if (r["model"], r["level"], r["allocator"]) == (model, lv, allocator)
                    ),
                    0.0,
                )
                for lv in levels
            ]
            ax.bar([j + i * width for j in range(len(levels))], values, width, label=allocator)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(levels))])
        ax.set_xticklabels(["fp32" if lv == "L0" else lv for lv in levels], fontsize=8)
        ax.set_title(model, fontsize=9)
        ax.set_ylabel("peak RSS growth (MiB)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(allocators), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--levels", default="L0,L1,L2,L2.2")
    p.add_argument("--allocators", default="default,glibc-tuned,tcmalloc")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--compile",
        default=None,
        help="torch.compile backend (inductor, aot_eager; BACKEND/blocks: block by block)",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "LEVEL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(worker(*args.worker, args.steps, args.data, args.compile)))
        return []
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        raise ValueError(f"unknown model(s) {sorted(unknown)}; choose from {', '.join(MODELS)}")
    records = run_all(args)
    publish(records, table, plot, json_path=args.json, plot_path=args.plot)
    return records


if __name__ == "__main__":
    main()
