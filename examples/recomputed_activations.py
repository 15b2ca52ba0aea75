"""What recomputing activations written as several operations saves and costs.

transformers' GPT-2 (the workloads' 4x128 on tiny-shakespeare) with its MLP activation set to each
of ``--activations`` (``gelu_new``, GPT-2's own; ``quick_gelu``, CLIP's; ``gelu_fast``), at each
level, with the activation's intermediates recomputed from its input in the backward (the
default, NOTE [Recomputed activations] in gact/recomputed.py) and stored
(``GactConfig(recompute_activations=False)``):

- memory: the bytes a step stores, the compression ratio and the live-tensor peak of a step (what
  a perfect allocator would hold; on CUDA, ``max_memory_allocated``);
- time: fp32 and both variants at each level interleaved in rounds in one process (the order
  rotating), each round's median step over fp32's, median and worst over rounds;
- training: ``--train-steps`` steps from the same weights and batches per seed at
  ``--train-levels``, both variants and fp32; the mean loss of the last 20 steps.

    python examples/recomputed_activations.py --data ../shared/data --json recomputed.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from gact import Controller, GactConfig
from gact_examples.memory import live_tensor_peak
from gact_examples.runs import publish
from gact_examples.workloads import Workload, workload

VARIANTS = {"recomputed": True, "stored": False}  # name -> recompute_activations
TAIL = 20  # steps averaged for the training loss


def gpt2(data: str, activation: str, seed: int) -> Workload:
    """The workloads' GPT-2 with ``activation`` (a key of transformers' ``ACT2FN``) in every
    MLP, from the weights of ``seed``."""
    from transformers.activations import ACT2FN

    torch.manual_seed(seed)
    work = workload("gpt2", data)
    for block in work.model.transformer.h:
        block.mlp.act = ACT2FN[activation]
    return work


def _controller(work: Workload, level: str, variant: str, seed: int = 0) -> Controller | None:
    if level == "fp32":
        return None
    config = GactConfig.from_level(level, seed=seed, recompute_activations=VARIANTS[variant])
    return Controller(work.model, config)


def _stepper(work: Workload, ctl: Controller | None) -> Callable[[int], float]:
    def step(i: int) -> float:
        def closure() -> torch.Tensor:
            loss = work.loss(i)
            work.optimizer.zero_grad()
            loss.backward()
            return loss

        loss = closure() if ctl is None else ctl.iterate(closure)
        work.optimizer.step()
        return float(loss.detach())

    return step


def memory(data: str, activation: str, level: str, variant: str) -> dict[str, Any]:
    """Stored bytes, ratio and live-tensor peak of step 3 (after an adaptation at step 0)."""
    work = gpt2(data, activation, 0)
    ctl = _controller(work, level, variant)
    assert ctl is not None
    step = _stepper(work, ctl)
    with ctl:
        for i in range(3):
            step(i)
        _, peak = live_tensor_peak(lambda: step(3))
    stats = ctl.stats()
    return {"kind": "memory", "activation": activation, "level": level, "variant": variant,
            "stored_bytes": stats["stored_bytes"], "original_bytes": stats["original_bytes"],
            "ratio": stats["ratio"], "peak_bytes": peak}  # fmt: skip


def timing(
    data: str, activation: str, levels: Sequence[str], rounds: int, steps: int
) -> list[dict]:
    """Step time of fp32 and of both variants at each level, interleaved in rounds."""
    runs = {("fp32", "-"): None} | {(lv, v): None for lv in levels for v in VARIANTS}
    built = {}
    for level, variant in runs:
        work = gpt2(data, activation, 0)
        built[level, variant] = (work, _controller(work, level, variant), [])
    names = list(built)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            work, ctl, times = built[name]
            step = _stepper(work, ctl)
            if ctl is not None:
                ctl.install_hook()
            spent = []
            for i in range(steps + 1):  # the first step of a round warms the caches up
                start = time.perf_counter()
                step(r * (steps + 1) + i)
                if i:
                    spent.append(time.perf_counter() - start)
            if ctl is not None:
                ctl.uninstall_hook()
            times.append(statistics.median(spent))
    fp32 = built["fp32", "-"][2]
    return [
        {
            "kind": "time",
            "activation": activation,
            "level": level,
            "variant": variant,
            "step_s": statistics.median(times),
            "ratio_median": statistics.median(t / f for t, f in zip(times, fp32)),
            "ratio_worst": max(t / f for t, f in zip(times, fp32)),
        }
        for (level, variant), (_, _, times) in built.items()
        if level != "fp32"
    ]


def training(data: str, activation: str, level: str, variant: str, seed: int, steps: int) -> dict:
    """``steps`` steps from the weights and rounding streams of ``seed``."""
    work = gpt2(data, activation, seed)
    ctl = _controller(work, level, variant, seed)
    step = _stepper(work, ctl)
    if ctl is not None:
        ctl.install_hook()
    try:
        losses = [step(i) for i in range(steps)]
    finally:
        if ctl is not None:
            ctl.uninstall_hook()
    tail = statistics.fmean(losses[-TAIL:])
    return {"kind": "train", "activation": activation, "level": level, "variant": variant,
            "seed": seed, "losses": losses, "tail_loss": tail}  # fmt: skip


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| activation | level | variant | stored MiB | fp32 / stored | live peak MiB |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        if r["kind"] == "memory":
            lines.append(f"| {r['activation']} | {r['level']} | {r['variant']} | "
                         f"{r['stored_bytes'] / 2**20:.1f} | {r['ratio']:.2f}x | "
                         f"{r['peak_bytes'] / 2**20:.1f} |")  # fmt: skip
    lines += [
        "",
        "| activation | level | variant | step vs fp32, median (worst) |",
        "|---|---|---|---|",
    ]
    for r in records:
        if r["kind"] == "time":
            lines.append(f"| {r['activation']} | {r['level']} | {r['variant']} | "
                         f"{r['ratio_median']:.2f}x ({r['ratio_worst']:.2f}x) |")  # fmt: skip
    lines += [
        "",
        f"| activation | level | variant | seed | loss, last {TAIL} steps |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        if r["kind"] == "train":
            lines.append(f"| {r['activation']} | {r['level']} | {r['variant']} | {r['seed']} | "
                         f"{r['tail_loss']:.4f} |")  # fmt: skip
    return "\n".join(lines)


def _names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--activations", default="gelu_new,quick_gelu,gelu_fast")
    p.add_argument("--levels", default="L1,L2,L1.2,L2.2", help="levels of the memory table")
    p.add_argument("--time-levels", default="L1,L2", help="levels of the time table")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run and round")
    p.add_argument("--train-levels", default="L2", help="levels trained ('' for none)")
    p.add_argument("--train-activations", default="gelu_new")
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--seeds", default="0,1,2", help="seeds of the training runs")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in _names(args.seeds)]
    records: list[dict[str, Any]] = []
    for activation in _names(args.activations):
        for level in _names(args.levels):
            records += [memory(args.data, activation, level, v) for v in VARIANTS]
        if args.rounds:
            records += timing(args.data, activation, _names(args.time_levels), args.rounds,
                              args.steps)  # fmt: skip
    for activation in _names(args.train_activations):
        for seed in seeds:
            runs = [("fp32", "-")] + [(lv, v) for lv in _names(args.train_levels) for v in VARIANTS]
            for level, variant in runs:
                rec = training(args.data, activation, level, variant, seed, args.train_steps)
                records.append(rec)
                print(f"{activation} {level} {variant} seed {seed}: {rec['tail_loss']:.4f}",
                      flush=True)  # fmt: skip
    publish(records, table, lambda rs, path: None, json_path=args.json, plot_path=None)
    return records


if __name__ == "__main__":
    main()
