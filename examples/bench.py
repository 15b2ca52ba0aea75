"""Benchmark the examples over GACT levels and seeds; write BENCHMARKS.md's examples section.

    python examples/bench.py --data DATA             # full: every example, 3 seeds
    python examples/bench.py --data DATA --quick     # minutes: small configs, 1 seed
    nox -s "bench(examples)"

DATA holds ``mnist/``, ``cora/``, ``cifar10-jpg/`` and ``tinyshakespeare/``. Every run is a
subprocess (``examples/*/train_*.py ... --json FILE``) so that peak memory is per run. Levels L0
(fp32, measuring-only hooks), L1, L1.2, L2, L2.2, plus L3 when CUDA is available, and L2@L1 and
L2.2@L1.2: the adaptive level given the uniform level's stored bytes of the same example and seed
as its memory budget (NOTE [Matched levels] in ``gact_examples.levels``). Besides the training
runs, some examples get an activation-dominated memory run per level (``--get-mem``: a few
steps at a large batch). On CUDA, the largest batch that fits is found by binary search in
subprocesses (CNN and transformer), as in the paper.

Writes the part of BENCHMARKS.md between ``<!-- examples:begin -->`` and
``<!-- examples:end -->`` (the rest of the file is kept) and PNG plots into ``plots/``. What runs
is data in ``gact_examples.bench.specs``; the tables and plots are ``gact_examples.bench.tables``
and ``gact_examples.bench.plots``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gact_examples.bench.plots import plot
from gact_examples.bench.specs import BASE_LEVELS, EXAMPLES, SCRIPTS, Example, Plan, run_args
from gact_examples.bench.tables import render, write_markdown
from gact_examples.data import default_cache_dir, default_data_root
from gact_examples.levels import split_level
from gact_examples.runs import machine_info, python_command, run_json

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Plan]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=default_data_root(), help="the folder holding all datasets")
    p.add_argument("--seeds", type=int, default=None, help="seeds per config (3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="small configs for a fast check")
    p.add_argument("--examples", default=",".join(e.name for e in EXAMPLES))
    p.add_argument(
        "--levels",
        default=None,
        help=f"comma-separated; A@U: level A at U's stored bytes (default {','.join(BASE_LEVELS)}, "
        "+L3 on CUDA)",
    )
    p.add_argument("--no-mem", action="store_true", help="skip the memory runs")
    p.add_argument("--no-max-batch", action="store_true", help="skip the GPU max-batch search")
    p.add_argument("--device", default=None)
    p.add_argument("--work-dir", default=None, help="JSON records and logs (default: cache dir)")
    p.add_argument("--resume", action="store_true", help="reuse records already in --work-dir")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: write the report from the records already in --work-dir",
    )
    p.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--plots", default=str(ROOT / "plots"))
    p.add_argument("--timeout", type=float, default=1800, help="per-run timeout (s)")
    args = p.parse_args(argv)
    if args.data is None:
        p.error("pass --data DIR (the folder holding mnist/, cora/, ...) or set GACT_DATA")
    import torch

    args.cuda = torch.cuda.is_available() and args.device != "cpu"
    levels = args.levels.split(",") if args.levels else [*BASE_LEVELS, *(["L3"] * args.cuda)]
    levels = [lv.strip() for lv in levels if lv.strip()]
    for i, level in enumerate(levels):
        try:
            uniform = split_level(level)[1]
        except KeyError as exc:
            p.error(str(exc.args[0]))
        if uniform is not None and uniform not in levels[:i]:
            p.error(f"level {level} runs at {uniform}'s stored bytes: list {uniform} before it")
    by_name = {e.name: e for e in EXAMPLES}
    names = [n.strip() for n in args.examples.split(",") if n.strip()]
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        p.error(f"unknown example(s) {unknown}; choose from {sorted(by_name)}")
    plan = Plan(
        examples=tuple(by_name[n] for n in names),
        levels=tuple(levels),
        seeds=args.seeds or (1 if args.quick else 3),
        quick=args.quick,
        memory=not args.no_mem,
        data=args.data,
        device=args.device,
    )
    return args, plan


def _command(ex: Example, options: list[str]) -> list[str]:
    return python_command(HERE / SCRIPTS[ex.script], options)


# --------------------------------------------------------------------------------------------
# GPU max-batch search (binary search in subprocesses until OOM)


def fits(ex: Example, plan: Plan, level: str, batch: int, work: Path, timeout: float) -> bool:
    """Whether two steps of ``ex``'s memory configuration run at ``batch`` without OOM."""
    jpath = work / f"maxbatch-{ex.name}-{level}-{batch}.json"
    options = run_args(ex, plan, level, 0, jpath, "mem")
    options[options.index("--mem-steps") + 1] = "2"
    if "--batch-size" in options:
        options[options.index("--batch-size") + 1] = str(batch)
    else:
        options += ["--batch-size", str(batch)]
    rec = run_json(_command(ex, options), jpath, timeout=timeout)
    if "error" in rec and "out of memory" not in rec.get("output_tail", "").lower():
        print(f"  max-batch probe {ex.name} {level} b={batch}: {rec['error']}", file=sys.stderr)
    return "error" not in rec


def max_batch(ex: Example, plan: Plan, level: str, work: Path, timeout: float) -> int:
    """The largest batch that fits, to about 3%, doubling from 64 and then bisecting."""
    lo, hi, cap = 0, 64, 1 << 17
    while hi <= cap and fits(ex, plan, level, hi, work, timeout):
        lo, hi = hi, hi * 2
    if lo == 0:
        return 0
    while hi - lo > max(1, lo // 32):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(ex, plan, level, mid, work, timeout) else (lo, mid)
    return lo


# --------------------------------------------------------------------------------------------


def _jobs(plan: Plan) -> list[tuple[Example, str, str, int]]:
    jobs = []
    for ex in plan.examples:
        for seed in range(plan.seeds):
            for level in plan.levels:  # interleaved: load changes hit every level alike
                jobs.append((ex, "train", level, seed))
        if plan.memory and ex.mem:
            jobs += [(ex, "mem", level, 0) for level in plan.own_levels]
    return jobs


def memory_budget(results: dict[str, Any], ex: Example, level: str, seed: int) -> int | None:
    """A matched level's budget: the stored bytes of its uniform level's training run of the
    same example and seed (NOTE [Matched levels]); ``None`` for other levels.

    Raises:
        LookupError: that run failed or has not run.
    """
    uniform = split_level(level)[1]
    if uniform is None:
        return None
    for rec in results["train"].get(ex.name, {}).get(uniform, []):
        if rec.get("seed") == seed:
            return int(rec["stored_bytes"])
    raise LookupError(f"no {uniform} run of seed {seed} to take its stored bytes from")


def collect(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """Run (or, with --resume / --report-only, reuse) every job; return the grouped records."""
    from tqdm.auto import tqdm

    work = Path(args.work_dir) if args.work_dir else default_cache_dir() / "bench"
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "train": {},
        "mem": {},
        "max_batch": {},
        "failures": [],
        "missing": [],
    }
    tag = "quick" if plan.quick else "full"
    start = time.time()
    bar = tqdm(_jobs(plan), desc="bench", dynamic_ncols=True, disable=args.report_only)
    for ex, kind, level, seed in bar:
        bar.set_postfix_str(f"{ex.name} {level} seed {seed} {kind}")
        jpath = work / f"{tag}-{kind}-{ex.name}-{level}-s{seed}.json"
        if (args.resume or args.report_only) and jpath.exists():
            rec = json.loads(jpath.read_text())
        elif args.report_only:
            results["missing"].append(f"{ex.name} {kind} {level} seed {seed}")
            continue
        else:
            try:
                budget = memory_budget(results, ex, level, seed)
            except LookupError as exc:
                results["failures"].append(f"{ex.name} {kind} {level} seed {seed}: {exc}")
                continue
            options = run_args(ex, plan, level, seed, jpath, kind, budget)
            rec = run_json(
                _command(ex, options), jpath, jpath.with_suffix(".log"), timeout=args.timeout
            )
        if "error" in rec:
            msg = f"{ex.name} {kind} {level} seed {seed}: {rec['error']}"
            tqdm.write(f"FAILED {msg}\n{rec.get('output_tail', '')}")
            results["failures"].append(msg)
            continue
        results[kind].setdefault(ex.name, {}).setdefault(level, []).append(rec)
    if args.cuda and not args.no_max_batch and not args.report_only:
        for ex in (e for e in plan.examples if e.max_batch):
            results["max_batch"][ex.name] = {
                level: max_batch(ex, plan, level, work, args.timeout) for level in plan.own_levels
            }
    results["wall_s"] = None if args.report_only else time.time() - start
    results["work_dir"] = str(work)
    (work / f"results-{tag}.json").write_text(json.dumps(results, indent=1, default=str))
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args, plan = parse_args(argv)
    machine = machine_info()
    results = collect(args, plan)
    section = render(plan, results, machine)
    write_markdown(Path(args.markdown), section)
    plot(plan, results, Path(args.plots))
    print(section)
    print(
        f"\nwrote {args.markdown} and {args.plots}/examples_*.png; records in {results['work_dir']}"
    )
    return results


if __name__ == "__main__":
    main()
