"""GACT against what users pick instead: checkpointing, selective checkpointing and compile's
activation memory budget, side by side on one model per family.

Per model (``gact_examples.workloads``: the ResNet-18 layout on CIFAR-10, GPT-2 from
``transformers`` on tiny-shakespeare, a GCN on Cora) and method, a fresh process trains
``--steps`` steps on the same batches from the same initial weights and reports

- ``rss``: the growth of its peak resident set over the size before the first step, under the
  process's own malloc (glibc's default: what users run);
- ``live``: the peak of live tensor bytes during one training step after the warm-up, over
  those live when it starts (the torch profiler's allocation events: independent of the C
  allocator, what CUDA's ``max_memory_allocated`` would count);
- the median step time after the warm-up (compile's first step is timed apart), and the held-out
  loss and accuracy after the last step.

With ``--device cuda`` the model and batches live on the GPU, every step is timed between two
synchronisations, and ``live`` is the CUDA allocator's peak during the profiled step over what
was allocated before it (``max_memory_allocated``), with the allocator's reserved peak beside it
(``reserved_bytes`` in the JSON record); ``rss`` then measures the host process only.

Methods (``METHODS``): ``fp32``; ``ckpt``, ``torch.utils.checkpoint`` (non-reentrant) around every
block (ResNet's BasicBlocks, GPT-2's layers, the GCN's convolutions); ``selective``, selective
activation checkpointing around every block that saves the outputs of matrix products and
convolutions and recomputes the rest; ``budget``, ``torch.compile`` with
``torch._functorch.config.activation_memory_budget = 0.5``; GACT ``L1``, ``L2``, ``L2.2``; and GACT
with every block checkpointed, ``L1+ckpt`` and ``L2+ckpt`` (GACT compresses what is saved outside
the blocks and keeps the blocks' inputs, NOTE [Checkpointed regions] in gact/origins.py) and
``L1+ckpt+ci`` (``compress_checkpoint_inputs=True``: the blocks' inputs compressed too). On CUDA
also ``offload``, ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the whole step
(every saved tensor waits in pinned host memory), and GACT ``L3`` (L2's payloads wait there).

    python examples/compare.py --data ../shared/data --json compare.json \\
        --plot plots/compare.png          # = nox -s "bench(compare)"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from gact_examples.runs import publish
from torch import nn

MODELS = ("resnet18", "gpt2", "gcn", "encoder6")
METHODS = ("fp32", "ckpt", "selective", "budget", "L1", "L2", "L2.2", "L1+ckpt", "L2+ckpt",
           "L1+ckpt+ci", "offload", "L3")  # fmt: skip
CUDA_ONLY = ("offload", "L3")  # offload is a CUDA method; L3 behaves as L2 on the CPU
STEPS = {"resnet18": 30, "gpt2": 30, "gcn": 100, "encoder6": 10}
WARMUP = 2  # steps before the profiled step and the timed ones (compile compiles in the first)


class Checkpointed(nn.Module):
    """Runs ``block`` under ``torch.utils.checkpoint`` (non-reentrant), optionally selective."""

    def __init__(self, block: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(self.block, *args, use_reentrant=False, **extra, **kwargs)


def checkpoint_blocks(
    model: nn.Module, names: Sequence[str], context_fn: Callable[[], Any] | None = None
) -> None:
    """Replace each named submodule of ``model`` with a ``Checkpointed`` wrapper of it."""
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, Checkpointed(model.get_submodule(name), context_fn))


def _saved_by_selective() -> set[Any]:
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.convolution.default}  # fmt: skip


def selective_context() -> Any:
    """Selective activation checkpointing: keep matrix products and convolutions, recompute the
    rest (``torch.utils.checkpoint.create_selective_checkpoint_contexts``)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_by_selective()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def worker(
    model_name: str, method: str, steps: int, data: str, device: str = "cpu"
) -> dict[str, Any]:
    """One run in this process (see the module docstring)."""
    from gact import Controller, GactConfig
    from gact_examples.memory import MemoryMeter, live_tensor_peak, status_bytes
    from gact_examples.workloads import workload

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    cuda = torch.device(device).type == "cuda"
    if method in CUDA_ONLY and not cuda:
        raise ValueError(f"method {method!r} runs on CUDA only (--device cuda)")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    work = workload(model_name, data, device)
    if method == "ckpt" or "+ckpt" in method:
        checkpoint_blocks(work.model, work.blocks)
    elif method == "selective":
        checkpoint_blocks(work.model, work.blocks, selective_context)
    elif method == "budget":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = 0.5
        work.model.compile()
    controller = None
    if method.startswith("L"):
        level = method.split("+")[0]
        config = GactConfig.from_level(level, compress_checkpoint_inputs=method.endswith("+ci"))
        controller = Controller(work.model, config)

    def train(i: int) -> None:
        def closure() -> torch.Tensor:
            with (
                torch.autograd.graph.save_on_cpu(pin_memory=True)
                if method == "offload"
                else (contextlib.nullcontext())
            ):
                loss = work.loss(i)
            work.optimizer.zero_grad()
            loss.backward()
            return loss

        if controller is None:
            closure()
        else:
            controller.iterate(closure)
        work.optimizer.step()

    baseline = status_bytes("VmRSS")
    times, first = [], 0.0
    live, reserved = 0, None
    with controller if controller is not None else contextlib.nullcontext():
        for i in range(steps):
            if i == WARMUP:
                if cuda:  # the allocator's peak of the step over what it held before
                    meter = MemoryMeter(torch.device(device))
                    meter.start()
                    train(i)
                    meter.stop()
                    live, reserved = meter.delta, meter.reserved_peak
                else:
                    _, live = live_tensor_peak(lambda i=i: train(i))
                continue
            sync()
            start = time.perf_counter()
            train(i)
            sync()
            spent = time.perf_counter() - start
            if i == 0:
                first = spent
            elif i > WARMUP:
                times.append(spent)
    peak = status_bytes("VmHWM") - baseline
    metrics = work.evaluate()
    return {
        "model": model_name,
        "method": method,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "steps": steps,
        "rss_bytes": peak,
        "live_bytes": live,
        "reserved_bytes": reserved,
        "step_s": statistics.median(times),
        "first_step_s": first,
        **metrics,
    }


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    from gact_examples.runs import python_command, run_json

    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for method in args.methods:
                out = Path(tmp) / "record.json"
                options = ["--worker", model, method, "--data", args.data, "--json", str(out)]
                options += ["--steps", str(args.steps or STEPS[model]), "--device", args.device]
                rec = run_json(
                    python_command(Path(__file__), [*options, "--threads", str(args.threads)]), out
                )
                if "error" in rec:
                    reason = rec["output_tail"].strip().splitlines()[-1:] or [rec["error"]]
                    rec = {"model": model, "method": method, "error": reason[0][-300:]}
                    print(f"{model:9s} {method:10s} failed: {rec['error']}", file=sys.stderr)
                else:
                    print(
                        f"{model:9s} {method:10s} rss +{rec['rss_bytes'] / 2**20:5.0f} MiB, live "
                        f"{rec['live_bytes'] / 2**20:5.0f} MiB, step "
                        f"{1e3 * rec['step_s']:6.0f} ms, loss {rec['loss']:.3f}",
                        file=sys.stderr,
                        flush=True,
                    )
                records.append(rec)
    return records


def pareto(points: dict[str, tuple[float, float]]) -> set[str]:
    """The names whose (memory, time) no other point matches or beats in both and beats in one."""
    front = set()
    for name, (m, t) in points.items():
        dominated = any(
            (m2 <= m and t2 <= t) and (m2 < m or t2 < t)
            for other, (m2, t2) in points.items()
            if other != name
        )
        if not dominated:
            front.add(name)
    return front


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model: each method's ratios to fp32 and the Pareto fronts (rss and live vs time)."""
    out: dict[str, dict[str, Any]] = {}
    for model in dict.fromkeys(r["model"] for r in records):
        runs = {r["method"]: r for r in records if r["model"] == model and "error" not in r}
        base = runs.get("fp32")
        if base is None:
            continue
        time_ratio = {m: r["step_s"] / base["step_s"] for m, r in runs.items()}
        out[model] = {
            "time_ratio": time_ratio,
            "front_rss": pareto({m: (r["rss_bytes"], time_ratio[m]) for m, r in runs.items()}),
            "front_live": pareto({m: (r["live_bytes"], time_ratio[m]) for m, r in runs.items()}),
        }
    return out


def _mib(rec: dict[str, Any], base: dict[str, Any], field: str) -> str:
    """``123 MiB (0.45)``: the figure and its ratio to fp32's."""
    return f"{rec[field] / 2**20:.0f} MiB ({rec[field] / max(base[field], 1):.2f})"


def table(records: list[dict[str, Any]]) -> str:
    """One row per model and method, peaks with their ratio to fp32's in brackets; * marks the
    Pareto front of (peak, step time)."""
    summary = summarise(records)
    lines = [
        "| model | method | peak RSS growth, default malloc | peak live tensors in a step | "
        "step time vs fp32 | held-out loss | accuracy |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        model, method = rec["model"], rec["method"]
        if "error" in rec:
            lines.append(f"| {model} | {method} | failed: {rec['error'][:80]} | | | | |")
            continue
        info = summary.get(model)
        if info is None:
            continue
        rss_mark = "*" if method in info["front_rss"] else ""
        live_mark = "*" if method in info["front_live"] else ""
        base = next(r for r in records if r["model"] == model and r["method"] == "fp32")
        rss = f"{_mib(rec, base, 'rss_bytes')}{rss_mark}"
        live = f"{_mib(rec, base, 'live_bytes')}{live_mark}"
        acc = "-" if math.isnan(rec["accuracy"]) else f"{100 * rec['accuracy']:.1f}%"
        lines.append(
            f"| {model} | {method} | {rss} | {live} | {info['time_ratio'][method]:.2f}x | "
            f"{rec['loss']:.3f} | {acc} |"
        )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarise(records)
    models = list(summary)
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        runs = [r for r in records if r["model"] == model and "error" not in r]
        ratio = summary[model]["time_ratio"]
        panels = (
            ("rss_bytes", "peak RSS growth, default malloc (MiB)", "front_rss"),
            ("live_bytes", "peak live tensors in a step (MiB)", "front_live"),
        )
        for row, (field, label, front_key) in enumerate(panels):
            ax = axes[row][col]
            front = summary[model][front_key]
            for r in runs:
                gact = r["method"].startswith("L")
                x, y = ratio[r["method"]], r[field] / 2**20
                ax.scatter(x, y, marker="o" if gact else "s", s=36,
                           c="tab:red" if gact else "tab:blue",
                           edgecolors="black" if r["method"] in front else "none")  # fmt: skip
                ax.annotate(r["method"], (x, y), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
            pts = sorted((ratio[r["method"]], r[field] / 2**20) for r in runs
                         if r["method"] in front)  # fmt: skip
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "k--", lw=0.8)
            ax.set_xlabel("step time / fp32's", fontsize=8)
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(model, fontsize=9)
    fig.suptitle("GACT (red) against checkpointing and compile (blue); outlined: Pareto front",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--methods", default=None, help="default: all (CUDA_ONLY ones on CUDA)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--steps", type=int, default=None, help=f"default per model: {STEPS}")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        record = worker(*args.worker, args.steps or STEPS[args.worker[0]], args.data, args.device)
        if args.json:
            Path(args.json).write_text(json.dumps(record))
        return [record]
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: torch.cuda.is_available() is False here")
    if args.methods is None:
        args.methods = ",".join(m for m in METHODS if cuda or m not in CUDA_ONLY)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS)) + sorted(set(args.methods) - set(METHODS))
    if unknown:
        raise ValueError(
            f"unknown model(s) or method(s) {unknown}; models: {', '.join(MODELS)}; methods: "
            f"{', '.join(METHODS)}"
        )
    if not cuda and set(args.methods) & set(CUDA_ONLY):
        raise ValueError(f"methods {', '.join(CUDA_ONLY)} run on CUDA only (--device cuda)")
    if args.steps is not None and args.steps <= WARMUP + 1:
        raise ValueError(f"--steps must exceed {WARMUP + 1} (warm-up, profiled and timed steps)")
    if "fp32" not in args.methods:
        args.methods.insert(0, "fp32")
    records = run_all(args)
    publish(records, table, plot, json_path=args.json, plot_path=args.plot)
    return records


if __name__ == "__main__":
    main()
