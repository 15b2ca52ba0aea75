"""Benchmark the examples over GACT levels and seeds; write BENCHMARKS.md's examples section.

    python examples/bench.py --data ../shared/data             # full: every example, 3 seeds
    python examples/bench.py --data ../shared/data --quick     # minutes: small configs, 1 seed
    nox -s "bench(examples)"

Every run is a subprocess (``examples/*/train_*.py ... --json FILE``) so that peak memory is per
run. Levels L0 (fp32, measuring-only hooks), L1, L2, L2.2, plus L3 when CUDA is available.
Besides the training runs, each example gets an activation-dominated memory run per level
(``--get-mem``: a few steps at a large batch). On CUDA, the largest batch that fits is found by
binary search in subprocesses (CNN and transformer), as in the paper.

Writes the part of BENCHMARKS.md between ``<!-- examples:begin -->`` and
``<!-- examples:end -->`` (the rest of the file is kept) and PNG plots into ``plots/``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make examples/ importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from common.data import default_cache_dir, default_data_root
from common.report import (
    bar_chart,
    display_command,
    fmt_ms,
    level_label,
    machine_info,
    mean_std,
    run_json,
    script_command,
)

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- examples:begin -->", "<!-- examples:end -->"
BASE_LEVELS = ("L0", "L1", "L2", "L2.2")


@dataclass
class Example:
    name: str
    script: str
    title: str
    train: list[str]  # training-run arguments (full size)
    quick: list[str]  # --quick arguments
    mem: list[str] | None  # activation-dominated memory run (--get-mem), None: no memory run
    metric: str = "test_accuracy"
    target: float = 0.5  # allowed gap to fp32 at L2 (points, or % of loss)
    max_batch: bool = False  # GPU max-batch search
    batch_flag: list[str] = field(default_factory=list)


def _a(s: str) -> list[str]:
    return s.split()


# Sized so that all six examples x 4 levels x 3 seeds finish in about 40 minutes on 2 CPU cores.
EXAMPLES = [
    Example(
        "gcn",
        "gnn",
        "GCN / Cora",
        _a("--model gcn --epochs 100"),
        _a("--model gcn --epochs 50"),
        None,
    ),
    Example(
        "sage",
        "gnn",
        "GraphSAGE / Cora",
        _a("--model sage --epochs 100"),
        _a("--model sage --epochs 50"),
        None,
    ),
    Example(
        "gat",
        "gnn",
        "GAT / Cora",
        _a("--model gat --epochs 100"),
        _a("--model gat --epochs 50"),
        None,
    ),
    Example(
        "mnist",
        "vision",
        "ResNet-small / MNIST",
        _a("--dataset mnist --epochs 1 --train-subset 15000"),
        _a("--dataset mnist --epochs 1 --train-subset 2000 --test-subset 2000"),
        _a("--dataset mnist --blocks 3 --batch-size 512 --mem-steps 3"),
        target=0.3,
        max_batch=True,
    ),
    Example(
        "cifar10",
        "vision",
        "ResNet-small / CIFAR-10 (JPEG)",
        _a("--dataset cifar10 --epochs 1 --train-subset 10000 --test-subset 5000"),
        _a("--dataset cifar10 --epochs 1 --train-subset 1000 --test-subset 1000"),
        None,
        target=1.0,
    ),
    Example(
        "text",
        "text",
        "char-GPT / tiny-shakespeare",
        _a("--epochs 1 --steps-per-epoch 250"),
        _a("--epochs 1 --steps-per-epoch 40 --eval-batches 5"),
        _a("--n-layer 6 --batch-size 64 --block-size 128 --mem-steps 3"),
        metric="val_loss",
        target=2.0,
        max_batch=True,
    ),
]
TARGETS = {"L2_ratio": 7.0, "L2.2_ratio": 12.0, "peak_reduction": 3.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=default_data_root(), help="parent of all dataset dirs")
    p.add_argument("--seeds", type=int, default=None, help="seeds per config (3; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="small configs for a fast check")
    p.add_argument("--examples", default=",".join(e.name for e in EXAMPLES))
    p.add_argument("--levels", default=None, help="default L0,L1,L2,L2.2 (+L3 on CUDA)")
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
    args.levels = [lv.strip() for lv in levels if lv.strip()]
    names = {e.name for e in EXAMPLES}
    args.examples = [n.strip() for n in args.examples.split(",") if n.strip()]
    unknown = set(args.examples) - names
    if unknown:
        p.error(f"unknown example(s) {sorted(unknown)}; choose from {sorted(names)}")
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    return args


def run_args(ex: Example, args, level: str, seed: int, json_path: Path, kind: str) -> list[str]:
    if kind == "mem":
        base = [*(ex.mem or []), "--get-mem"]
    else:
        base = ex.quick if args.quick else ex.train
    a = ["--data", str(args.data), *base, "--seed", str(seed), "--gact", "--level", level]
    if args.device:
        a += ["--device", args.device]
    return [*a, "--no-progress", "--json", str(json_path)]


def command_template(ex: Example, args, kind: str) -> str:
    a = run_args(ex, args, "LEVEL", 0, Path("OUT.json"), kind)
    a[a.index("--seed") + 1] = "SEED"
    return display_command(script_command(ex.script, a))


# --------------------------------------------------------------------------------------------
# GPU max-batch search (binary search in subprocesses until OOM)


def fits(ex: Example, args, level: str, batch: int, work: Path) -> bool:
    jpath = work / f"maxbatch-{ex.name}-{level}-{batch}.json"
    a = run_args(ex, args, level, 0, jpath, "mem")
    a[a.index("--mem-steps") + 1] = "2"
    i = a.index("--batch-size") if "--batch-size" in a else None
    if i is None:
        a += ["--batch-size", str(batch)]
    else:
        a[i + 1] = str(batch)
    rec = run_json(script_command(ex.script, a), jpath, timeout=args.timeout)
    if "error" in rec and "out of memory" not in rec.get("output_tail", "").lower():
        print(f"  max-batch probe {ex.name} {level} b={batch}: {rec['error']}", file=sys.stderr)
    return "error" not in rec


def max_batch(ex: Example, args, level: str, work: Path, start: int = 64, cap: int = 1 << 17):
    lo, hi = 0, start
    while hi <= cap and fits(ex, args, level, hi, work):
        lo, hi = hi, hi * 2
    if lo == 0:
        return 0
    hi = min(hi, cap * 2)
    while hi - lo > max(1, lo // 32):  # ~3% resolution
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(ex, args, level, mid, work) else (lo, mid)
    return lo


# --------------------------------------------------------------------------------------------


def collect(args) -> dict:
    from tqdm.auto import tqdm

    work = Path(args.work_dir) if args.work_dir else default_cache_dir() / "bench"
    work.mkdir(parents=True, exist_ok=True)
    exs = [e for e in EXAMPLES if e.name in args.examples]
    jobs = []
    for ex in exs:
        for seed in range(args.seeds):
            for level in args.levels:  # interleaved: load changes hit every level alike
                jobs.append((ex, "train", level, seed))
        if not args.no_mem and ex.mem:
            jobs += [(ex, "mem", level, 0) for level in args.levels]
    results: dict = {"train": {}, "mem": {}, "max_batch": {}, "failures": [], "missing": []}
    t0 = time.time()
    bar = tqdm(jobs, desc="bench", dynamic_ncols=True, disable=args.report_only)
    for ex, kind, level, seed in bar:
        bar.set_postfix_str(f"{ex.name} {level} seed {seed} {kind}")
        tag = "quick" if args.quick else "full"
        jpath = work / f"{tag}-{kind}-{ex.name}-{level}-s{seed}.json"
        if (args.resume or args.report_only) and jpath.exists():
            rec = json.loads(jpath.read_text())
        elif args.report_only:
            results["missing"].append(f"{ex.name} {kind} {level} seed {seed}")
            continue
        else:
            cmd = script_command(ex.script, run_args(ex, args, level, seed, jpath, kind))
            rec = run_json(cmd, jpath, jpath.with_suffix(".log"), timeout=args.timeout)
        if "error" in rec:
            msg = f"{ex.name} {kind} {level} seed {seed}: {rec['error']}"
            tqdm.write(f"FAILED {msg}\n{rec.get('output_tail', '')}")
            results["failures"].append(msg)
            continue
        results[kind].setdefault(ex.name, {}).setdefault(level, []).append(rec)
    if args.cuda and not args.no_max_batch and not args.report_only:
        for ex in exs:
            if ex.max_batch:
                for level in args.levels:
                    results["max_batch"].setdefault(ex.name, {})[level] = max_batch(
                        ex, args, level, work
                    )
    results["wall_s"] = None if args.report_only else time.time() - t0
    results["work_dir"] = str(work)
    (work / f"results-{'quick' if args.quick else 'full'}.json").write_text(
        json.dumps(results, indent=1, default=str)
    )
    return results


def stat(recs, key, scale=1.0):
    m, s, n = mean_std([r.get(key) for r in recs])
    return m * scale, s * scale, n


def render(args, results, machine) -> str:
    exs = [e for e in EXAMPLES if e.name in args.examples]
    lv = args.levels
    L = []
    w = L.append
    w(BEGIN)
    w("## Examples: accuracy, activation memory and speed per GACT level\n")
    if results["wall_s"] is not None:
        wall = f"wall time {results['wall_s'] / 60:.1f} min"
    else:
        recs = [
            r for k in ("train", "mem") for e in results[k].values() for v in e.values() for r in v
        ]
        wall = "report regenerated from saved records; their training time sums to " + (
            f"{sum(r.get('train_time_s') or 0 for r in recs) / 60:.1f} min"
        )
    w(
        f"Generated by `python examples/bench.py --data DATA{' --quick' if args.quick else ''}"
        f" --seeds {args.seeds}` on {time.strftime('%Y-%m-%d %H:%M %Z')} ({wall}). "
        f"Numbers are mean ± std over {args.seeds} seed(s) unless marked (n=). fp32 = level L0 "
        "(GACT's measuring-only hooks: tensors stored unchanged and counted; see the note under "
        "the activation table for how its count differs).\n"
    )
    w("**Machine**: " + ", ".join(f"{k} {v}" for k, v in machine.items()) + "\n")
    if results.get("missing"):
        w(
            f"**Not run** ({len(results['missing'])} of the planned runs; the benchmark was "
            "stopped before them, tables use the completed seeds, n shown where fewer): "
            + "; ".join(results["missing"])
            + "\n"
        )
    if results["failures"]:
        w("**Failed runs** (excluded from the tables): " + "; ".join(results["failures"]) + "\n")

    # ---- accuracy
    w("### Final metric (test accuracy %, or validation loss in nats/char)\n")
    w("| example | " + " | ".join(level_label(x) for x in lv) + " | L2 − fp32 | target | met |")
    w("|---|" + "---|" * (len(lv) + 3))
    checks = []
    for ex in exs:
        rs = results["train"].get(ex.name, {})
        scale = 100.0 if ex.metric == "test_accuracy" else 1.0
        cells = []
        for x in lv:
            m, s, n = stat(rs.get(x, []), "final_metric", scale)
            cells.append(
                fmt_ms(m, s, 2 if scale == 100 else 3)
                + (f" (n={n})" if n and n != args.seeds else "")
            )
        f32, _, _ = stat(rs.get("L0", []), "final_metric", scale)
        l2, _, _ = stat(rs.get("L2", []), "final_metric", scale)
        if ex.metric == "test_accuracy":
            gap = l2 - f32
            met = gap >= -ex.target
            gap_s, tgt = f"{gap:+.2f} pt", f"≥ −{ex.target} pt"
        else:
            gap = (l2 - f32) / f32 * 100 if f32 else math.nan
            met = gap <= ex.target
            gap_s, tgt = f"{gap:+.2f} %", f"≤ +{ex.target} %"
        ok = "n/a" if math.isnan(gap) else ("yes" if met else "**no**")
        if ex.name == "cifar10":
            tgt, ok = (
                f"(none; {tgt} for reference)",
                "–" if math.isnan(gap) else ("yes" if met else "no"),
            )
        else:
            checks.append((f"{ex.title}: L2 metric gap", gap_s, tgt, ok))
        w(f"| {ex.title} | " + " | ".join(cells) + f" | {gap_s} | {tgt} | {ok} |")
    w("")

    # ---- activation memory
    w("### Saved activations per training step (from `controller.stats()`)\n")
    comp = [x for x in lv if x != "L0"]
    overcount = False
    w(
        "| example | fp32, L0 count | fp32, unique | "
        + " | ".join(f"{level_label(x)} ratio" for x in comp)
        + " | L2 stored | L2.2 stored |"
    )
    w("|---|---|---|" + "---|" * (len(comp) + 2))
    for ex in exs:
        rs = results["train"].get(ex.name, {})
        ob, _, _ = stat(rs.get("L0", []), "original_bytes", 1 / 2**20)
        uq, _, _ = stat(rs.get("L2", []) or rs.get("L1", []), "original_bytes", 1 / 2**20)
        overcount = overcount or (ob > 1.01 * uq)
        cells = []
        for x in comp:
            m, s, _ = stat(rs.get(x, []), "compression_ratio")
            st, _, _ = stat(rs.get(x, []), "stored_bytes", 1 / 2**20)
            vs0 = ob / st if st else math.nan
            cells.append(fmt_ms(m, s, 1, unit="×") + f" ({vs0:.1f}× vs L0)")
            if x in ("L2", "L2.2") and not math.isnan(m):
                need = TARGETS[f"{x}_ratio"]
                checks.append(
                    (
                        f"{ex.title}: {x} compression",
                        f"{m:.1f}× ({vs0:.1f}× vs L0 count)",
                        f"≥ {need:g}×",
                        "yes" if m >= need else "**no**",
                    )
                )
        st2, _, _ = stat(rs.get("L2", []), "stored_bytes", 1 / 2**20)
        st22, _, _ = stat(rs.get("L2.2", []), "stored_bytes", 1 / 2**20)
        w(
            f"| {ex.title} | {ob:.2f} MiB | {uq:.2f} MiB | "
            + " | ".join(cells)
            + f" | {st2:.2f} MiB | {st22:.2f} MiB |"
        )
    w(
        "\nRatio = original_bytes / stored_bytes of the same run's last training step (fp32 bytes "
        "of every distinct tensor autograd saved, over what GACT kept; index tensors and other "
        "non-float tensors are kept as they are and count on both sides). *fp32, L0 count* is "
        "what level L0's measuring hooks report, *fp32, unique* the original_bytes of the L2 run; "
        '"vs L0" divides the L0 count by the level\'s stored bytes.'
        + (
            " Where the two fp32 columns differ, the runtime version used counted a tensor saved "
            "by two operators (e.g. a ReLU output saved by the ReLU and by the next convolution) "
            "twice at L0 but once at the compressing levels (fixed in gact-runtime 9967bfd)."
            if overcount
            else ""
        )
        + "\n"
    )

    # ---- speed
    w("### Median step time and throughput (training runs)\n")
    w("| example | " + " | ".join(level_label(x) for x in lv) + " | unit |")
    w("|---|" + "---|" * (len(lv) + 1))
    for ex in exs:
        rs = results["train"].get(ex.name, {})
        cells, unit = [], ""
        for x in lv:
            m, _, _ = stat(rs.get(x, []), "step_time_s", 1e3)
            t, _, _ = stat(rs.get(x, []), "throughput")
            cells.append(f"{m:.1f} ms ({t:,.0f}/s)" if not math.isnan(m) else "n/a")
            unit = unit or next((r.get("throughput_unit", "") for r in rs.get(x, [])), "")
        w(f"| {ex.title} | " + " | ".join(cells) + f" | {unit} |")
    w(
        "\nStep time = forward + backward (+ compression, and the sensitivity probes on the steps "
        "where an adaptive level runs them; the median hides those). The CPU was shared with other "
        "jobs during the run, so step times are indicative only.\n"
    )

    # ---- memory runs
    if results["mem"]:
        w("### Peak memory, activation-dominated configurations (`--get-mem`, 3 steps, seed 0)\n")
        w(
            "| example (config) | "
            + " | ".join(level_label(x) for x in lv)
            + " | fp32 / L2 | target |"
        )
        w("|---|" + "---|" * (len(lv) + 2))
        for ex in exs:
            rs = results["mem"].get(ex.name, {})
            if not rs:
                continue
            cells = []
            for x in lv:
                r = (rs.get(x) or [None])[0]
                cells.append(
                    "n/a"
                    if r is None
                    else f"+{r['peak_memory_delta_bytes'] / 2**20:.0f} MiB "
                    f"(saved {r['stored_bytes'] / 2**20:.0f} MiB)"
                )
            f = (rs.get("L0") or [None])[0]
            q = (rs.get("L2") or [None])[0]
            red = (
                f["peak_memory_delta_bytes"] / max(1, q["peak_memory_delta_bytes"])
                if f and q
                else math.nan
            )
            ok = (
                "n/a"
                if math.isnan(red)
                else ("yes" if red >= TARGETS["peak_reduction"] else "**no**")
            )
            checks.append(
                (
                    f"{ex.title}: peak memory fp32/L2 ({' '.join(ex.mem)})",
                    f"{red:.2f}×",
                    f"≥ {TARGETS['peak_reduction']:g}×",
                    ok,
                )
            )
            w(
                f"| {ex.title} (`{' '.join(ex.mem)}`) | "
                + " | ".join(cells)
                + f" | {red:.2f}× | ≥ {TARGETS['peak_reduction']:g}× |"
            )
        meth = next(
            (r[0].get("memory_method") for e in results["mem"].values() for r in e.values() if r),
            "",
        )
        w(
            f"\nPeak = {meth}, minus the resident size just before training (data, model, "
            "interpreter). Only the configurations here are activation-dominated; the training "
            "runs' peaks are in the JSON records.\n"
        )

    # ---- max batch
    if results["max_batch"]:
        w("### Largest batch that fits (GPU, binary search until OOM)\n")
        w("| example | " + " | ".join(level_label(x) for x in lv) + " |")
        w("|---|" + "---|" * len(lv))
        for name, per in results["max_batch"].items():
            title = next(e.title for e in EXAMPLES if e.name == name)
            w(f"| {title} | " + " | ".join(str(per.get(x, "n/a")) for x in lv) + " |")
        w("")
    else:
        w(
            "Max-batch search (binary search in subprocesses until CUDA OOM) runs only on a GPU; "
            "this run had none.\n"
        )

    # ---- checklist
    w("### Targets\n")
    w("| check | measured | target | met |")
    w("|---|---|---|---|")
    for c in checks:
        w("| " + " | ".join(c) + " |")
    w("")

    # ---- commands
    w("### Commands\n")
    w(
        "Each cell above is one run of (LEVEL ∈ "
        + ", ".join(lv)
        + f"; SEED ∈ 0..{args.seeds - 1}):\n"
    )
    w("```")
    for ex in exs:
        w(command_template(ex, args, "train"))
    if not args.no_mem:
        for ex in exs:
            if ex.mem:
                w(command_template(ex, args, "mem"))
    w("```\n")
    w(
        "Whole benchmark: `"
        + shlex.join(
            [
                "python",
                "examples/bench.py",
                "--data",
                "DATA",
                *(["--quick"] if args.quick else []),
                "--seeds",
                str(args.seeds),
            ]
        )
        + "` "
        '(or `nox -s "bench(examples)"`). Plots: `plots/examples_metric.png`, '
        "`plots/examples_memory.png`.\n"
    )
    w(END)
    return "\n".join(L)


def write_markdown(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        pre, rest = text.split(BEGIN, 1)
        post = rest.split(END, 1)[1]
        text = pre + section + post
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def plot(args, results) -> None:
    exs = [e for e in EXAMPLES if e.name in args.examples and e.name in results["train"]]
    labels = [level_label(x) for x in args.levels]
    plots = Path(args.plots)
    panels = []
    for ex in exs:
        rs = results["train"][ex.name]
        scale = 100.0 if ex.metric == "test_accuracy" else 1.0
        ms = [stat(rs.get(x, []), "final_metric", scale) for x in args.levels]
        unit = "test acc %" if scale == 100 else "val loss"
        panels.append(
            (f"{ex.title}\n({unit})", labels, [m for m, _, _ in ms], [s for _, s, _ in ms])
        )
    if panels:
        bar_chart(
            plots / "examples_metric.png",
            "Final metric per level (mean ± std over seeds)",
            panels,
            figsize=(2.3 * min(len(panels), 6), 3.0 * math.ceil(len(panels) / 6)),
            ncols=6,
        )
    panels = []
    for ex in exs:
        rs = results["train"][ex.name]
        ms = [stat(rs.get(x, []), "stored_bytes", 1 / 2**20) for x in args.levels]
        panels.append(
            (
                f"{ex.title}\nsaved act. MiB/step",
                labels,
                [m for m, _, _ in ms],
                [s for _, s, _ in ms],
            )
        )
    for ex in exs:
        rs = results["mem"].get(ex.name, {})
        if rs:
            vals = [
                ((rs.get(x) or [{}])[0].get("peak_memory_delta_bytes") or math.nan) / 2**20
                for x in args.levels
            ]
            panels.append(
                (
                    f"{ex.title}\npeak +MiB ({' '.join(ex.mem[-2:])})",
                    labels,
                    vals,
                    [0.0] * len(vals),
                )
            )
    if panels:
        bar_chart(
            plots / "examples_memory.png",
            "Activation memory per level",
            panels,
            figsize=(2.3 * min(len(panels), 6), 3.0 * math.ceil(len(panels) / 6)),
        )


def main(argv=None) -> dict:
    args = parse_args(argv)
    machine = machine_info()
    results = collect(args)
    section = render(args, results, machine)
    write_markdown(Path(args.markdown), section)
    plot(args, results)
    print(section)
    print(
        f"\nwrote {args.markdown} and {args.plots}/examples_*.png; records in {results['work_dir']}"
    )
    return results


if __name__ == "__main__":
    main()
