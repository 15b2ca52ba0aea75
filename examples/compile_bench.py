"""torch.compile with GACT: compiled runs against eager ones, same model, level and batches.

Per model (``gact_examples.workloads``: transformers GPT-2 on tiny-shakespeare, the ResNet-18
layout on CIFAR-10, the char-GPT and MNIST memory configurations, ...) every run in ``--runs``
(``BACKEND:LEVEL``; ``eager`` for no compile, ``fp32`` for no GACT; compiled in place with
``nn.Module.compile``, or ``BACKEND/blocks`` to compile each of the workload's blocks alone, as
large models are compiled block by block) starts from the same weights and sees the same batches. Each records every
step's training loss, the live-tensor peak of step ``--peak-step`` (the torch profiler's
allocations: what a perfect allocator would hold, as ``max_memory_allocated`` on CUDA), step
times, the held-out loss and accuracy at the end, what GACT stored, the compiled save sites it
compressed and kept, and the graphs dynamo compiled. The table gives each run's mean training
loss over the last ``--tail`` steps against the eager run of its level, and its peak against the
fp32 run of its backend. With several ``--seeds`` (initial weights and GACT's rounding streams;
the batches stay the same), every run is repeated per seed, compared with the eager run of its
level and seed, and a summary gives each compiled run's difference from eager over the seeds
(mean, standard deviation, and its standard error): a difference that compiling alone makes
shows in the fp32 rows. Runs are sequential: take step-time ratios from ``speed_bench.py
--compile`` (interleaved), not from here.

``--gradient-error SAMPLES`` asks what a final loss cannot tell apart from SGD's amplified noise:
whether compiling changes what GACT's rounding does to the gradient. The model trains
``--warmup`` steps in eager fp32; from those weights, per compiled or eager run of a GACT level,
``SAMPLES`` steps compute the gradient of one batch without updating the weights (the rounding
streams advance, dropout masks stay, an adaptive level adapts on its schedule without a time
budget; ``L2@L1`` runs L2 at L1's stored bytes, ``--memory-budget`` every adaptive level at
those bytes, as it does in training runs), and each is compared with the fp32 gradient of the
same backend: the relative squared error ``|g - g_fp32|^2 / |g_fp32|^2``, averaged from the
step after the last adaptation on.

    python examples/compile_bench.py --data ../shared/data --models gpt2,resnet18 --steps 200
    python examples/compile_bench.py --data ../shared/data --models resnet18 --steps 200 \
        --seeds 0,1,2 --runs eager:L2,inductor:L2,eager:fp32,inductor:fp32
    python examples/compile_bench.py --data ../shared/data --models mnist,char-gpt --steps 4 \
        --runs eager:fp32,eager:L1,inductor:fp32,inductor:L1,aot_eager:fp32,aot_eager:L1
    python examples/compile_bench.py --data ../shared/data --models gpt2 --steps 4 \
        --runs eager:fp32,eager:L1,inductor/blocks:fp32,inductor/blocks:L1
    python examples/compile_bench.py --data ../shared/data --models resnet18 --threads 1 \
        --gradient-error 30 --warmup 20 --runs eager:L1.2,inductor:L1.2,eager:L2,inductor:L2
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from gact import Controller, GactConfig
from gact_examples.levels import split_level
from gact_examples.memory import live_tensor_peak
from gact_examples.runs import publish
from gact_examples.workloads import parse_models, workload


def train(
    name: str,
    data: str,
    level: str,
    backend: str | None,
    steps: int,
    peak_step: int,
    seed: int = 0,
    memory_budget: int | None = None,
) -> dict[str, Any]:
    """One run: ``steps`` steps of model ``name`` at ``level`` (``fp32``: no GACT), compiled
    with ``backend`` (``None``: eager; ``BACKEND/blocks``: each of the workload's blocks
    alone), from the weights and rounding streams of ``seed``; an adaptive level at
    ``memory_budget`` bytes if given."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    work = workload(name, data)
    if backend is not None:
        work.compile(backend)
    config = None if level == "fp32" else GactConfig.from_level(level, seed=seed)
    if config is not None and config.spec.adaptive and memory_budget is not None:
        config = dataclasses.replace(config, memory_budget=memory_budget)
    ctl = None if config is None else Controller(work.model, config)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    losses, times, peak = [], [], None
    if ctl is not None:
        ctl.install_hook()
    try:
        for i in range(steps):
            start = time.perf_counter()

            def closure(i: int = i) -> torch.Tensor:
                loss = work.loss(i)
                work.optimizer.zero_grad()
                loss.backward()
                return loss

            def step(closure: Any = closure) -> torch.Tensor:
                loss = closure() if ctl is None else ctl.iterate(closure)
                work.optimizer.step()
                return loss

            if i == peak_step:
                loss, peak = live_tensor_peak(step)
            else:
                loss = step()
            losses.append(float(loss))
            times.append(time.perf_counter() - start)
    finally:
        if ctl is not None:
            ctl.uninstall_hook()
    record: dict[str, Any] = {
        "model": name,
        "run": f"{backend or 'eager'} {level}",
        "backend": backend,
        "level": level,
        "seed": seed,
        "losses": losses,
        "peak_bytes": peak,
        "step_s": statistics.median(times[1:]) if steps > 1 else times[0],
        "first_step_s": times[0],
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
        **{f"heldout_{k}": v for k, v in work.evaluate().items()},
    }
    if ctl is not None:
        st, sites = ctl.stats(), ctl.hooks.compiled_sites.values()
        record.update(
            ratio=st["ratio"],
            adaptations=st["adaptations"],
            compile_s=st["compile_seconds"],
            compiled_compressed=sum(s.keep is None for s in sites),
            compiled_kept=sorted(f"{s.key}: {s.keep}" for s in sites if s.keep is not None),
        )
    return record


def _gradient(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameter gradients, flattened into one vector."""
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def gradient_error(
    name: str,
    data: str,
    level: str,
    backend: str | None,
    warmup: int,
    samples: int,
    seed: int = 0,
    memory_budget: int | None = None,
) -> dict[str, Any]:
    """The relative squared error of GACT's gradient at ``level`` (``L2@L1``: L2 at L1's stored
    bytes; an adaptive level at ``memory_budget`` bytes if given) against fp32's, both compiled
    with ``backend`` (``None``: eager), at the weights of ``warmup`` eager fp32 steps from
    ``seed``'s, over ``samples`` steps on batch ``warmup`` without weight updates, with the
    same dropout masks."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    work = workload(name, data)
    for i in range(warmup):  # the same eager fp32 steps for every run of this seed
        loss = work.loss(i)
        work.optimizer.zero_grad()
        loss.backward()
        work.optimizer.step()
    if backend is not None:
        work.compile(backend)
    state = copy.deepcopy(work.model.state_dict())  # BatchNorm statistics move in each step

    def closure() -> torch.Tensor:
        work.model.load_state_dict(state)
        torch.manual_seed(seed)  # the same dropout masks in every sample and the reference
        loss = work.loss(warmup)
        work.optimizer.zero_grad()
        loss.backward()
        return loss

    closure()
    reference = _gradient(work.model).clone()
    adaptive, uniform = split_level(level)
    config = GactConfig.from_level(adaptive, seed=seed, adapt_budget=None)
    budget = memory_budget if config.spec.adaptive else None
    if uniform is not None:  # a matched level's: its uniform level's bytes (NOTE [Matched levels])
        with Controller(work.model, GactConfig.from_level(uniform, seed=seed)) as ctl:
            ctl.iterate(closure)
            budget = ctl.stats()["stored_bytes"]
    if budget is not None:
        config = dataclasses.replace(config, memory_budget=budget)
    ctl = Controller(work.model, config)
    errors, adapted, count = [], [], 0
    with ctl:
        for _ in range(samples):
            ctl.iterate(closure)
            g = _gradient(work.model)
            errors.append(float((g - reference).square().sum() / reference.square().sum()))
            adapted.append(ctl.stats()["adaptations"] > count)
            count = ctl.stats()["adaptations"]
    last = max((i for i, a in enumerate(adapted) if a), default=-1)
    tail = errors[last + 1 :] or errors[-1:]
    return {
        "model": name,
        "run": f"{backend or 'eager'} {level}",
        "backend": backend,
        "level": level,
        "seed": seed,
        "errors": errors,
        "adapted_at": [i for i, a in enumerate(adapted) if a],
        "error": statistics.fmean(tail),
        "ratio": ctl.stats()["ratio"],
        "stored_bytes": ctl.stats()["stored_bytes"],
    }


def gradient_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| model | run | seed | relative squared error | vs eager | stored ratio | adapted at |",
        "|---|---|---|---|---|---|---|",
    ]
    eager = {(r["model"], r["level"], r["seed"]): r["error"] for r in records if not r["backend"]}
    for r in records:
        ref = eager.get((r["model"], r["level"], r["seed"]))
        versus = "-" if ref is None or not ref else f"{r['error'] / ref:.2f}x"
        adapted = ", ".join(map(str, r["adapted_at"])) or "-"
        lines.append(
            f"| {r['model']} | {r['run']} | {r['seed']} | {r['error']:.4g} | {versus} | "
            f"{r['ratio']:.2f}x | {adapted} |"
        )
    return "\n".join(lines)


def _tail_means(records: list[dict[str, Any]], tail: int) -> dict[tuple, float]:
    """Each eager run's mean loss over its last ``tail`` steps, by (model, level, seed)."""
    return {
        (r["model"], r["level"], r["seed"]): statistics.fmean(r["losses"][-tail:])
        for r in records
        if r["backend"] is None
    }


def table(records: list[dict[str, Any]], tail: int = 20) -> str:
    lines = [
        f"| model | run | seed | loss, last {tail} steps | vs eager | held-out loss | live peak | "
        "fp32 / run | stored ratio | compiled sites stored / kept | graphs | step | first step "
        "(GACT's compilations) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = _tail_means(records, tail)
    fp32 = {
        (r["model"], r["backend"], r["seed"]): r["peak_bytes"]
        for r in records
        if r["level"] == "fp32"
    }
    for r in records:
        mean = statistics.fmean(r["losses"][-tail:])
        ref = eager.get((r["model"], r["level"], r["seed"]))
        versus = "-" if ref is None else f"{100 * (mean / ref - 1):+.2f}%"
        peak, base = r["peak_bytes"], fp32.get((r["model"], r["backend"], r["seed"]))
        shown = "-" if peak is None else f"{peak / (1 << 20):.0f} MiB"
        against = "-" if peak is None or base is None else f"{base / peak:.2f}x"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        compiling = f" ({r['compile_s']:.1f} s)" if r.get("compile_s") else ""
        sites = (
            f"{r['compiled_compressed']} / {len(r['compiled_kept'])}"
            if r["backend"] and "compiled_kept" in r
            else "-"
        )
        lines.append(
            f"| {r['model']} | {r['run']} | {r['seed']} | {mean:.4f} | {versus} | "
            f"{r['heldout_loss']:.4f} | {shown} | {against} | {ratio} | {sites} | {r['graphs']} | "
            f"{1e3 * r['step_s']:.0f} ms | {r['first_step_s']:.1f} s{compiling} |"
        )
    return "\n".join(lines)


def differences(records: list[dict[str, Any]], tail: int = 20) -> list[dict[str, Any]]:
    """Per model and compiled run: its loss over the last ``tail`` steps against the eager run
    of its level and seed, in percent, over the seeds that have both (mean, standard deviation,
    standard error of the mean; the last two ``nan`` for a single seed)."""
    eager = _tail_means(records, tail)
    by_run: dict[tuple[str, str], list[float]] = {}
    for r in records:
        ref = eager.get((r["model"], r["level"], r["seed"]))
        if r["backend"] is not None and ref is not None:
            mean = statistics.fmean(r["losses"][-tail:])
            by_run.setdefault((r["model"], r["run"]), []).append(100 * (mean / ref - 1))
    rows = []
    for (model, run), diffs in by_run.items():
        sd = statistics.stdev(diffs) if len(diffs) > 1 else math.nan
        rows.append(
            {
                "model": model,
                "run": run,
                "seeds": len(diffs),
                "percent": diffs,
                "mean": statistics.fmean(diffs),
                "sd": sd,
                "se": sd / math.sqrt(len(diffs)),
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--models", default="gpt2,resnet18")
    p.add_argument("--runs", default="eager:L2,inductor:L2,inductor:fp32",
                   help="BACKEND:LEVEL pairs (eager: no compile; fp32: no GACT)")  # fmt: skip
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--peak-step", type=int, default=2, help="the step whose peak is measured")
    p.add_argument("--tail", type=int, default=20, help="steps averaged for the table's loss")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (weights and rounding)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--gradient-error",
        type=int,
        default=0,
        metavar="SAMPLES",
        help="compare gradient errors at fixed weights instead of training",
    )
    p.add_argument(
        "--warmup", type=int, default=20, help="eager fp32 steps before --gradient-error"
    )
    p.add_argument("--memory-budget", type=int, default=None,
                   help="bytes for the adaptive levels (default: their levels' budgets)")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    models = parse_models(args.models)
    runs = [tuple(r.strip().split(":")) for r in args.runs.split(",") if r.strip()]
    if any(len(r) != 2 for r in runs):
        raise ValueError(f"--runs takes BACKEND:LEVEL pairs, got {args.runs!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        raise ValueError(f"--seeds takes comma-separated integers >= 0, got {args.seeds!r}")
    records = []
    for name in models:
        for seed in seeds:
            for backend, level in runs:
                compiled = None if backend == "eager" else backend
                if args.gradient_error:
                    if level == "fp32":
                        raise ValueError("--gradient-error compares GACT levels with fp32: "
                                         "leave fp32 out of --runs")  # fmt: skip
                    records.append(gradient_error(name, args.data, level, compiled, args.warmup,
                                                  args.gradient_error, seed, args.memory_budget))  # fmt: skip
                    print(gradient_table(records[-1:]).splitlines()[-1], flush=True)
                    continue
                records.append(
                    train(name, args.data, level, compiled, args.steps, args.peak_step, seed,
                          args.memory_budget)
                )  # fmt: skip
                print(table(records[-1:], args.tail).splitlines()[-1], flush=True)
    if args.gradient_error:
        publish(records, gradient_table, lambda rs, path: None, json_path=args.json,
                plot_path=None)  # fmt: skip
        return records
    for d in differences(records, args.tail):
        print(
            f"{d['model']} {d['run']} vs eager over {d['seeds']} seed(s): {d['mean']:+.2f}% "
            f"(sd {d['sd']:.2f}, se {d['se']:.2f}; per seed "
            + ", ".join(f"{v:+.2f}%" for v in d["percent"])
            + ")",
            flush=True,
        )
    publish(records, lambda rs: table(rs, args.tail), lambda rs, path: None,
            json_path=args.json, plot_path=None)  # fmt: skip
    return records


if __name__ == "__main__":
    main()
