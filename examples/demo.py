"""GACT in a few minutes: one small CNN trained at fp32 and with compressed activations.

    python examples/demo.py                 # scikit-learn's bundled 8x8 digits, no files needed
    python examples/demo.py --data DATA     # MNIST: DATA holds mnist/ (the four idx .gz files)
    nox -s demo                             # the same in a fresh environment (-- --data DATA)

Each level trains in its own process (``examples/vision/train_vision.py``), followed by a short
large-batch run, also in its own process, that measures peak memory. Prints one table and writes
a PNG chart and the JSON records to ``--out`` (default ``~/.cache/gact-examples/demo``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gact_examples.charts import Panel, bar_chart
from gact_examples.data import default_cache_dir
from gact_examples.levels import BASELINE, bits_label, chart_label, level_label
from gact_examples.runs import python_command, run_json
from gact_examples.train import LEVELS, fmt_bytes

TRAIN_SCRIPT = Path(__file__).resolve().parent / "vision" / "train_vision.py"
MIB = 1 / 2**20
NOTES = """\
test acc: one seed on {n_test} test images (one image = {point:.2f} points), so differences of
  about a point are noise.
saved act./step: what autograd holds for backward in one training step, counted by GACT's hooks,
  metadata included. fp32 is level L0: hooks installed, nothing compressed.
peak RSS: the process's peak resident memory over its pre-training baseline in a 3-step run at
  batch {mem_batch}, under the C allocator it runs with: glibc's default malloc keeps freed
  activation memory in the process, so this barely falls (BENCHMARKS.md, "The memory a user's
  process feels"; tcmalloc or jemalloc let it fall).
live peak: the most tensor bytes alive at once in one step of that run (what a GPU's allocator
  would hold). It falls much less than saved activations: weights, gradients, optimizer state
  and the backward pass's working set are not compressed.
fp32/level: how many times less than fp32.
Speed is not compared: on a shared CPU the step-time noise exceeds GACT's overhead (see
  BENCHMARKS.md). Adaptive levels (L2, L2.2) allocate their bits after the first step as if
  every tensor were equally sensitive, then re-allocate from sensitivities measured in the
  backward (this CNN's convolution and BatchNorm inputs: no extra forward or backward pass),
  whenever that costs at most 5% of the training time so far."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="train on MNIST from this folder instead of digits")
    p.add_argument("--levels", default="L0,L1,L2,L2.2", help="comma-separated; L0 = fp32")
    p.add_argument("--epochs", type=int, default=None, help="default: 5 (digits), 1 (MNIST)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--train-subset", type=int, default=6000, help="MNIST training images")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mem-batch",
        type=int,
        default=512,
        help="batch size of the 3-step memory run per level (0: no memory runs)",
    )
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="folder for the JSON records, logs and the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    args.levels = [s.strip() for s in args.levels.split(",") if s.strip()]
    bad = [lv for lv in args.levels if lv not in LEVELS]
    if bad or not args.levels:
        p.error(f"unknown or no level(s) {bad}; choose from {', '.join(LEVELS)}")
    return args


def train_options(args: argparse.Namespace, level: str, json_path: Path) -> list[str]:
    """Options of ``train_vision.py`` for one level's training run."""
    if args.data:
        options = ["--dataset", "mnist", "--data", args.data]
        options += ["--train-subset", str(args.train_subset), "--epochs", str(args.epochs or 1)]
    else:  # digits upsampled to 16x16 so that the convolutions have something to work on
        options = ["--dataset", "digits", "--image-size", "16", "--epochs", str(args.epochs or 5)]
    options += ["--batch-size", str(args.batch_size), "--seed", str(args.seed), "--width", "16"]
    options += ["--gact", "--level", level, "--json", str(json_path)]
    if args.device:
        options += ["--device", args.device]
    return options + (["--no-progress"] if args.quiet else [])


def _run(args: argparse.Namespace, options: list[str], json_path: Path) -> dict[str, Any]:
    interactive = sys.stderr.isatty() and not args.quiet  # the run's own progress bar shows
    cmd = python_command(TRAIN_SCRIPT, options)
    return run_json(cmd, json_path, json_path.with_suffix(".log"), show_stderr=interactive)


def run_level(args: argparse.Namespace, level: str, out: Path, step: str) -> dict[str, Any]:
    """Train one level, then measure its peak memory; print a line before and after each."""
    name = f"{level_label(level)} ({bits_label(level)})"
    print(f"{step} {name}: training ...", flush=True)
    start = time.perf_counter()
    jpath = out / f"demo-{level}.json"
    rec = _run(args, train_options(args, level, jpath), jpath)
    if "error" in rec:
        print(f"  failed ({rec['error']}):\n{rec['output_tail']}", flush=True)
        return {"level": level, **rec}
    print(
        f"  trained in {rec['train_time_s']:.0f} s: test accuracy {rec['final_metric']:.2%}, "
        f"saved activations {fmt_bytes(rec['stored_bytes'])} per step",
        flush=True,
    )
    rec["mem_run"] = None
    if args.mem_batch:
        print(f"  memory run: 3 steps at batch {args.mem_batch} ...", flush=True)
        mpath = out / f"demo-{level}-mem.json"
        options = train_options(args, level, mpath)
        options += ["--get-mem", "--mem-steps", "3", "--batch-size", str(args.mem_batch)]
        mrec = _run(args, options, mpath)
        if "error" in mrec:
            print(f"  memory run failed ({mrec['error']}):\n{mrec['output_tail']}", flush=True)
        else:
            rec["mem_run"] = mrec
    print(f"  {time.perf_counter() - start:.0f} s for this level", flush=True)
    return rec


def _mem(rec: dict[str, Any], field: str) -> float | None:
    """A figure of the level's memory run (None without one)."""
    return rec["mem_run"].get(field) if rec.get("mem_run") else None


def _peak(rec: dict[str, Any]) -> float | None:
    return _mem(rec, "peak_memory_delta_bytes")


def _live(rec: dict[str, Any]) -> float | None:
    return _mem(rec, "live_peak_bytes")


def _times(base: float | None, value: float | None) -> str:
    return f"{base / value:.1f}x" if base and value else "n/a"


def print_table(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    """One row per level, then the notes that say what each column measures."""
    ok = [r for r in records if "final_metric" in r]
    base = next((r for r in ok if r["level"] == BASELINE), None)
    base_saved, base_peak = (base["stored_bytes"], _peak(base)) if base else (None, None)
    base_live = _live(base) if base else None
    header = (
        f"{'level':<6} {'bits':<20} {'test acc':>8} {'saved act./step':>16} {'fp32/level':>10} | "
        f"{'peak RSS':>10} {'fp32/level':>10} | {'live peak':>10} {'fp32/level':>10}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in records:
        if "final_metric" not in r:
            print(f"{level_label(r['level']):<6} failed: {r['error']}")
            continue
        saved_ratio = _times(base_saved, r["stored_bytes"])
        peak_ratio, live_ratio = _times(base_peak, _peak(r)), _times(base_live, _live(r))
        print(
            f"{level_label(r['level']):<6} {bits_label(r['level']):<20} "
            f"{r['final_metric']:>8.2%} {fmt_bytes(r['stored_bytes']):>16} {saved_ratio:>10} | "
            f"{fmt_bytes(_peak(r)):>10} {peak_ratio:>10} | {fmt_bytes(_live(r)):>10} {live_ratio:>10}"
        )
    n_test = ok[0]["test_images"] if ok else 0
    point = 100 / n_test if n_test else float("nan")
    print("\n" + NOTES.format(n_test=n_test, point=point, mem_batch=args.mem_batch))


def _notes(records: list[dict[str, Any]], values: list[float], base: float | None) -> list[str]:
    """``fp32`` on the baseline's bar, ``N.Nx less`` on the others."""
    return [
        "fp32" if r["level"] == BASELINE else _times(base, v) + " less"
        for r, v in zip(records, values)
    ]


def draw_chart(
    path: Path, title: str, args: argparse.Namespace, records: list[dict[str, Any]]
) -> None:
    """Accuracy, saved activations and peak memory per level, each bar with its note."""
    ok = [r for r in records if "final_metric" in r]
    labels = [chart_label(r["level"]) for r in ok]
    base = next((r for r in ok if r["level"] == BASELINE), None)
    base_saved, base_live = (base["stored_bytes"], _live(base)) if base else (None, None)
    acc = [r["final_metric"] * 100 for r in ok]
    saved = [r["stored_bytes"] for r in ok]
    peaks = [_live(r) or float("nan") for r in ok]
    panels = [
        Panel("test accuracy (%)", labels, acc, [f"{a:.1f}%" for a in acc], limit=100.0),
        Panel(
            f"saved activations per step (MiB)\nbatch {args.batch_size}",
            labels,
            [s * MIB for s in saved],
            _notes(ok, saved, base_saved),
        ),
    ]
    if any(p == p for p in peaks):  # NaN != NaN: at least one memory run succeeded
        panels.append(
            Panel(
                f"peak live tensors in a step (MiB)\n3-step run at batch {args.mem_batch}",
                labels,
                [p * MIB for p in peaks],
                _notes(ok, peaks, base_live),
            )
        )
    footnote = (
        "One seed. fp32 is level L0: GACT's hooks installed, nothing compressed. Notes: accuracy, "
        "or how many times less than fp32. Saved activations: what autograd holds for backward in "
        "one training step, metadata included. Live tensors fall much less: weights, gradients, "
        "optimizer state and the backward pass's working set are not compressed; the process's "
        "resident peak under glibc's default malloc barely falls at all (see the printed table)."
    )
    bar_chart(path, title, panels, footnote=footnote)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    out = Path(args.out) if args.out else default_cache_dir() / "demo"
    out.mkdir(parents=True, exist_ok=True)
    dataset = "MNIST" if args.data else "scikit-learn digits (8x8 upsampled to 16x16)"
    names = ", ".join(f"{level_label(lv)} ({bits_label(lv)})" for lv in args.levels)
    print(f"GACT demo: a ResNet-style CNN on {dataset}, one seed.\nLevels: {names}.\n")
    start = time.perf_counter()
    n = len(args.levels)
    records = [run_level(args, lv, out, f"[{i}/{n}]") for i, lv in enumerate(args.levels, 1)]
    print_table(args, records)
    if any("final_metric" in r for r in records):
        title = f"GACT demo: ResNet-style CNN on {dataset}"
        draw_chart(out / "demo.png", title, args, records)
        print(f"\nchart: {out / 'demo.png'}")
    print(f"records and logs: {out}\ndemo wall time: {time.perf_counter() - start:.0f} s")
    return records


if __name__ == "__main__":
    main()
