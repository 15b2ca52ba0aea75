"""How far the GNN examples' reported accuracy moves without compression: model selection noise.

A Cora run reports the test accuracy of one epoch, chosen on the validation set. This script
trains, through ``gnn/train_gnn.py`` itself, for each model and training seed:

- fp32 once (the reference of the benchmark's gap);
- fp32 with its initial weights multiplied by ``1 + 0.01 N(0, 1)`` (``--init-noise``), ``--draws``
  draws: a perturbation that is not compression, so whatever gap it shows is the measurement's;
- each GACT level with ``--draws`` rounding seeds (``--gact-seed``), the training seed fixed;

and reports, for three ways of choosing the epoch (lowest validation loss, the examples' metric;
the first epoch of best validation accuracy, their metric until 2026-11-24; the last epoch), the
gap of each arm to fp32 averaged over draws and seeds, the range of the gap a single draw of
every seed gives (what one 3-seed benchmark sees), and the spread across draws within a seed.

    python examples/selection_noise.py --data ../shared/data --models gat --out selection.json
    python examples/selection_noise.py --report selection.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gact_examples.data import default_cache_dir, default_data_root
from gact_examples.runs import python_command, run_json

HERE = Path(__file__).resolve().parent
#: the record's key of each way of choosing the reported epoch
SELECTIONS = {
    "lowest validation loss": "final_metric",
    "best validation accuracy": "test_at_best_val_accuracy",
    "last epoch": "last_test_accuracy",
}
FP32 = "fp32"


def arms(levels: Sequence[str], init_noise: float) -> dict[str, list[str]]:
    """Each arm's extra options, with ``{draw}`` where the draw's seed goes."""
    noise = f"fp32, init noise {init_noise:g}"
    out = {noise: ["--init-noise", str(init_noise), "--noise-seed", "{draw}"]}
    for level in levels:
        out[level] = ["--gact", "--level", level, "--gact-seed", "{draw}"]
    return out


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Run (or reuse from ``--work-dir``) every run; return the records' selected accuracies."""
    work = Path(args.work_dir or default_cache_dir() / "selection-noise")
    work.mkdir(parents=True, exist_ok=True)
    plan = arms(args.levels.split(","), args.init_noise)
    runs: dict[str, Any] = {}
    for model in args.models.split(","):
        for seed in range(args.seeds):
            jobs = [(FP32, 0, [])] + [
                (arm, draw, [o.replace("{draw}", str(draw)) for o in options])
                for draw in range(args.draws)
                for arm, options in plan.items()
            ]
            for arm, draw, options in jobs:
                name = f"{model}-s{seed}-{arm.replace(' ', '_').replace(',', '')}-d{draw}"
                jpath = work / f"{name}.json"
                if jpath.exists():
                    rec = json.loads(jpath.read_text())
                else:
                    cmd = python_command(
                        HERE / "gnn" / "train_gnn.py",
                        [
                            *("--data", args.data, "--model", model, "--seed", str(seed)),
                            *("--epochs", str(args.epochs), "--no-progress", "--json", str(jpath)),
                            *options,
                        ],
                    )
                    rec = run_json(cmd, jpath, jpath.with_suffix(".log"))
                    if "error" in rec:
                        raise RuntimeError(f"{name} failed:\n{rec['output_tail']}")
                    print(f"{name}: {rec['final_metric']:.4f}", flush=True)
                key = f"{model}|{seed}|{arm}"
                runs.setdefault(key, []).append({s: rec[k] for s, k in SELECTIONS.items()})
    return {"models": args.models.split(","), "seeds": args.seeds, "arms": list(plan), "runs": runs}


def table(result: dict[str, Any]) -> str:
    """Markdown: per model and selection, each arm's gap to fp32 in accuracy points."""
    lines = [
        "| model | epoch chosen by | arm | gap to fp32, mean over draws | one draw per seed: "
        "range of the mean gap | sd across draws within a seed |",
        "|---|---|---|---|---|---|",
    ]
    runs, seeds = result["runs"], range(result["seeds"])
    for model in result["models"]:
        for selection in SELECTIONS:
            for arm in result["arms"]:
                ref = [100 * runs[f"{model}|{s}|{FP32}"][0][selection] for s in seeds]
                draws = [[100 * r[selection] for r in runs[f"{model}|{s}|{arm}"]] for s in seeds]
                per_seed = [statistics.fmean(d) - f for d, f in zip(draws, ref)]
                one_draw = [
                    statistics.fmean(d[k] - f for d, f in zip(draws, ref))
                    for k in range(len(draws[0]))
                ]
                spread = statistics.fmean(statistics.stdev(d) for d in draws)
                lines.append(
                    f"| {model} | {selection} | {arm} | {statistics.fmean(per_seed):+.2f} | "
                    f"{min(one_draw):+.2f} .. {max(one_draw):+.2f} | {spread:.2f} |"
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=default_data_root())
    p.add_argument("--models", default="gcn,sage,gat")
    p.add_argument("--levels", default="L1,L2")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--draws", type=int, default=4, help="perturbations and rounding seeds")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--init-noise", type=float, default=0.01)
    p.add_argument("--work-dir", default=None, help="records (reused when present)")
    p.add_argument("--out", default="selection-noise.json")
    p.add_argument("--report", default=None, metavar="JSON", help="print the table of a record")
    args = p.parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
    else:
        if args.data is None:
            p.error("pass --data DIR (the folder holding cora/) or set GACT_DATA")
        if args.draws < 2:
            p.error("--draws must be at least 2 (the spread within a seed needs two)")
        result = collect(args)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
