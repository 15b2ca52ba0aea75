"""Step time of real models, fp32 against every GACT level, interleaved in one process.

Per model (``gact_examples.workloads``: transformers GPT-2 and BERT from configs, the ResNet-18
layout, the char-GPT and MNIST memory configurations, a GCN on Cora, on real data) the script builds one copy
per level from the same initial weights and trains them in rounds: each round runs ``--steps``
steps of every level in turn (the order rotates between rounds), so that a slow phase of this
shared machine hits every level alike. A level's ratio is its median step time over fp32's
median *in the same round*; the table shows the median ratio over rounds and the worst one.
With ``--compile BACKEND`` every copy, fp32's included, is compiled in place
(``nn.Module.compile``, or block by block with ``BACKEND/blocks``; the first round's first
step compiles and is not timed). With
``--device cuda`` every step is timed between two synchronisations, and each level's memory is
also reported: the CUDA allocator's peak during its steps above what was allocated before them
(every copy's weights and optimizer state are already there, so this is the step's own memory:
activations, gradients in flight and the backward's working set), the largest over rounds.
With ``--profile`` one more step per level runs under ``torch.profiler`` after the rounds: the
host time of GACT's packs and unpacks per call (its ``gact::pack`` / ``gact::unpack`` ranges),
their number per step and, on CUDA, the host-device synchronisations and the GPU's busy time.

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
from gact_examples.memory import MemoryMeter
from gact_examples.workloads import Workload, parse_models, workload

LEVELS = ("fp32", "L0", "L1", "L2", "L1.2", "L2.2")


def measure(
    name: str,
    data: str,
    levels: Sequence[str],
    rounds: int,
    steps: int,
    backend: str | None,
    device: torch.device,
    profile: bool = False,
) -> dict:
    """Per level: the step times of every round (seconds) and the ratios to fp32's, on CUDA
    the step's peak memory (bytes), and with ``profile`` what one profiled step shows."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    runs = {}
    for level in levels:
        torch.manual_seed(0)
        work = workload(name, data, device)
        if backend is not None:
            work.compile(backend)
        ctl = None if level == "fp32" else Controller(work.model, GactConfig.from_level(level))
        runs[level] = (work, ctl)
    times: dict[str, list[list[float]]] = {level: [] for level in levels}
    peaks = dict.fromkeys(levels, 0)
    for r in range(rounds):
        order = [*levels[r % len(levels) :], *levels[: r % len(levels)]]
        for level in order:
            work, ctl = runs[level]
            if ctl is not None:
                ctl.install_hook()
            spent = []
            meter = MemoryMeter(device)
            if cuda:
                meter.start()
            for i in range(steps + 1):  # the first step of a round warms the caches up
                sync()
                start = time.perf_counter()
                _train_step(work, ctl, r * (steps + 1) + i)
                sync()
                if i:
                    spent.append(time.perf_counter() - start)
            if cuda:
                meter.stop()
                peaks[level] = max(peaks[level], meter.delta)
            if ctl is not None:
                ctl.uninstall_hook()
            times[level].append(spent)
    result: dict[str, Any] = {
        "model": name,
        "backend": backend,
        "device": str(device),
        "levels": {},
    }
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
        if cuda:
            result["levels"][level]["peak_bytes"] = peaks[level]
            result["levels"][level]["peak_ratio"] = peaks["fp32"] / max(peaks[level], 1)
        if profile:
            work, ctl = runs[level]
            result["levels"][level]["profile"] = profile_step(work, ctl, rounds * (steps + 1), cuda)
    return result


def _train_step(work: Workload, ctl: Controller | None, i: int) -> None:
    loss = work.loss(i)
    work.optimizer.zero_grad()
    loss.backward()
    work.optimizer.step()
    if ctl is not None:
        ctl.step()


def profile_step(work: Workload, ctl: Controller | None, i: int, cuda: bool) -> dict[str, float]:
    """One training step under ``torch.profiler``: GACT's packs and unpacks (count per step,
    mean host time per call in us, from the ``gact::`` ranges), and on CUDA the host-device
    synchronisations (``cudaStreamSynchronize`` calls), the waits for an event
    (``cudaEventSynchronize``: a pending save resolved by waiting) and the GPU's busy time
    (ms)."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if ctl is not None:
        ctl.install_hook()
    try:
        with torch.profiler.profile(activities=activities) as prof:
            _train_step(work, ctl, i)
            if cuda:
                torch.cuda.synchronize()
    finally:
        if ctl is not None:
            ctl.uninstall_hook()
    averages = prof.key_averages()
    # a range that launched kernels also shows as a GPU annotation of the same name: host only
    events = {e.key: e for e in averages if e.device_type == torch.autograd.DeviceType.CPU}
    out: dict[str, float] = {}
    for name in ("pack", "unpack"):
        event = events.get(f"gact::{name}")
        out[f"{name}s"] = 0 if event is None else event.count
        out[f"{name}_us"] = 0.0 if event is None else event.cpu_time_total / event.count
    if cuda:
        for name, key in (
            ("syncs", "cudaStreamSynchronize"),
            ("event_waits", "cudaEventSynchronize"),
        ):
            event = events.get(key)
            out[name] = 0 if event is None else event.count
        # kernels, copies and sets only: a GPU annotation spans kernels already counted
        gpu_us = sum(
            e.self_device_time_total
            for e in averages
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("gact::")
        )
        out["gpu_ms"] = gpu_us / 1e3
    return out


def profile_table(results: list[dict]) -> str:
    """Per model and GACT level: packs and unpacks per step and their mean host time."""
    lines = [
        "| model | level | packs (us each) | unpacks (us each) | syncs | event waits | GPU busy |"
    ]
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for res in results:
        for level, row in res["levels"].items():
            prof = row.get("profile")
            if prof is None:
                continue
            gpu = f"{prof['gpu_ms']:.2f} ms" if "gpu_ms" in prof else "-"
            lines.append(
                f"| {res['model']} | {level} | {prof['packs']} ({prof['pack_us']:.0f}) | "
                f"{prof['unpacks']} ({prof['unpack_us']:.0f}) | {prof.get('syncs', '-')} | "
                f"{prof.get('event_waits', '-')} | {gpu} |"
            )
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    levels = list(results[0]["levels"]) if results else []
    head = "| model | " + " | ".join(levels) + " |"
    lines = [head, "|---|" + "---|" * len(levels)]
    for res in results:
        cells = []
        for level in levels:
            row = res["levels"][level]
            if level == "fp32":
                cell = f"{1e3 * row['step_s']:.1f} ms"
            else:
                cell = f"{row['ratio_median']:.2f}x (worst {row['ratio_worst']:.2f}x)"
            if "peak_bytes" in row:
                cell += f", peak {row['peak_bytes'] / 2**20:.0f} MiB"
                cell += "" if level == "fp32" else f" (fp32/{level} {row['peak_ratio']:.2f}x)"
            cells.append(cell)
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
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--profile", action="store_true", help="profile one step per level after")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    models = parse_models(args.models)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {args.device}: torch.cuda.is_available() is False here; use --device cpu"
        )
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    if "fp32" not in levels:
        levels.insert(0, "fp32")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for name in models:
        results.append(
            measure(
                name, args.data, levels, args.rounds, args.steps, args.compile, device, args.profile
            )
        )
        print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if args.profile:
        print(profile_table(results))
    if args.json:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                "rounds": args.rounds, "steps": args.steps, "compile": args.compile,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}  # fmt: skip
        Path(args.json).write_text(json.dumps({**meta, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
