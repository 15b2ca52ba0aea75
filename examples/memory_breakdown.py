"""Where the peak comes from: a memory timeline per training phase, fp32 against GACT levels.

Runs the examples' activation-dominated memory configurations (the MNIST ResNet-style CNN with 3
blocks per stage at batch 512, and the 6-layer char-GPT at batch 64 x 128 tokens) for a few steps
at each level, each level in a fresh process, while a thread samples the process's resident size
(CPU; glibc's malloc tuned so the resident size follows live memory) or
``torch.cuda.memory_allocated`` (CUDA) every ``--interval`` seconds. Every sample is labelled with
the phase running: forward, backward, optimizer, or adaptation (GACT's probes; a model whose
saves are all measured in the backward, as the MNIST CNN's, adapts without them). Writes a JSON
record, a table of the peak per phase over the pre-training baseline, and a PNG timeline.

    python examples/memory_breakdown.py --data ../shared/data --out plots/memory_breakdown.png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gact import LEVELS, Controller, GactConfig
from gact_examples.data import load_char_corpus, load_mnist
from gact_examples.memory import tune_malloc_for_measurement
from gact_examples.models import CharGPT, ResNetSmall

PHASES = ("forward", "backward", "adaptation", "optimizer")
# A forward under ``torch.no_grad()`` before training: the eager working set (inputs, outputs and
# temporaries of the running ops) with nothing saved, the floor under any training peak.
REFERENCE = "no-grad forward"


class Sampler(threading.Thread):
    """Samples memory in use every ``interval`` seconds, labelled with ``self.phase``."""

    def __init__(self, device: torch.device, interval: float) -> None:
        super().__init__(daemon=True)
        self.device, self.interval = device, interval
        self.phase = "setup"
        self.samples: list[tuple[float, str, int]] = []
        self._halt = threading.Event()
        self._t0 = time.perf_counter()

    def read(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.perf_counter() - self._t0, self.phase, self.read()))
            time.sleep(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def mnist_task(data: str, device: torch.device, run: Any) -> tuple[torch.nn.Module, Any, Any]:
    d = load_mnist(data)
    x = torch.from_numpy(d["x_train"][:512]).float().div(255).unsqueeze(1).to(device)
    y = torch.from_numpy(d["y_train"][:512]).long().to(device)
    model = ResNetSmall(1, 10, 16, 3).to(device)
    fwd = run(model)
    return model, lambda: F.cross_entropy(fwd(x), y), torch.optim.SGD(model.parameters(), 0.05)


def char_gpt_task(data: str, device: torch.device, run: Any) -> tuple[torch.nn.Module, Any, Any]:
    corpus = load_char_corpus(data)
    ids = torch.from_numpy(corpus["train"])
    starts = torch.randint(0, len(ids) - 129, (64,), generator=torch.Generator().manual_seed(0))
    chunk = ids[starts.unsqueeze(1) + torch.arange(129)].to(device)
    model = CharGPT(len(corpus["chars"]), 128, 6, 4, 128, 0.1).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fwd = run(model)
    return model, lambda: fwd(chunk[:, :-1], chunk[:, 1:])[1], optimizer


TASKS = {"mnist": mnist_task, "char-gpt": char_gpt_task}


def measure(task: str, level: str, args: argparse.Namespace) -> dict[str, Any]:
    """One level in this process: the labelled timeline of ``args.steps`` training steps."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.compile:
        run = lambda m: torch.compile(m, backend=args.compile)  # noqa: E731
    else:
        run = lambda m: m  # noqa: E731
    model, loss_fn, optimizer = TASKS[task](args.data, device, run)
    sampler = Sampler(device, args.interval)
    # adaptive levels probe from step 1 on, so that the timeline shows an adaptation's peak
    options = dict(adapt_first_gap=1, adapt_budget=None) if LEVELS[level].adaptive else {}
    controller = Controller(model, GactConfig.from_level(level, **options))

    warmup = [args.compile is not None]  # the first compiled step compiles: not measured

    def closure() -> torch.Tensor:
        label = "warmup" if warmup[0] else None
        sampler.phase = label or ("adaptation" if controller.hooks.probing else "forward")
        loss = loss_fn()
        optimizer.zero_grad()
        sampler.phase = label or ("adaptation" if controller.hooks.probing else "backward")
        loss.backward()
        return loss

    baseline = sampler.read()
    sampler.start()
    if not args.compile:
        sampler.phase = REFERENCE
        with torch.no_grad():
            loss_fn()
    with controller:
        for _ in range(args.steps):
            controller.iterate(closure)
            sampler.phase = "warmup" if warmup[0] else "optimizer"
            optimizer.step()
            warmup[0] = False
    sampler.phase = "done"
    sampler.stop()
    st = controller.stats()
    # a phase with no sample (L0 and L1 never adapt; a short optimizer step can fall between two
    # samples) has no peak: None, shown as "-", never as 0
    peaks = {
        phase: max((m - baseline for _, p, m in sampler.samples if p == phase), default=None)
        for phase in (*PHASES, REFERENCE)
    }
    return {
        "task": task if not args.compile else f"{task} (compile: {args.compile})",
        "level": level,
        "baseline_bytes": baseline,
        "peak_by_phase": peaks,
        "peak_bytes": max(peaks[p] for p in PHASES if peaks[p] is not None),
        "saved_bytes": st["original_bytes"],
        "stored_bytes": st["stored_bytes"],
        "adaptations": controller.adapter.count,
        "samples": sampler.samples,
    }


def table(records: list[dict[str, Any]]) -> str:
    mib = 1 << 20
    lines = [
        "| task | level | saved activations | stored | "
        + " | ".join(f"peak in {p}" for p in PHASES)
        + f" | peak | fp32 / level | {REFERENCE} + stored |",
        "|---" * (7 + len(PHASES)) + "|",
    ]
    fp32 = {r["task"]: r["peak_bytes"] for r in records if r["level"] == "L0"}
    for r in records:
        peaks = r["peak_by_phase"]
        cells = ["-" if peaks[p] is None else f"{peaks[p] / mib:.0f} MiB" for p in PHASES]
        ratio = fp32.get(r["task"], 0) / max(r["peak_bytes"], 1)
        lines.append(
            f"| {r['task']} | {r['level']} | {r['saved_bytes'] / mib:.0f} MiB | "
            f"{r['stored_bytes'] / mib:.0f} MiB | " + " | ".join(cells)
            + f" | {r['peak_bytes'] / mib:.0f} MiB | {ratio:.2f}x | "
            f"{((peaks[REFERENCE] or 0) + r['stored_bytes']) / mib:.0f} MiB |"
        )  # fmt: skip
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in records})
    colors = {"forward": "tab:blue", "backward": "tab:red", "adaptation": "tab:purple",
              "optimizer": "tab:green", "setup": "0.6", "done": "0.6"}  # fmt: skip
    fig, axes = plt.subplots(len(tasks), 1, figsize=(11, 4.2 * len(tasks)), squeeze=False)
    for ax, task in zip(axes[:, 0], tasks):
        for r in (r for r in records if r["task"] == task):
            t = [s[0] for s in r["samples"]]
            m = [(s[2] - r["baseline_bytes"]) / (1 << 20) for s in r["samples"]]
            ax.plot(
                t, m, lw=1.2, label=f"{r['level']} (peak {r['peak_bytes'] / (1 << 20):.0f} MiB)"
            )
        shaded = [r for r in records if r["task"] == task][-1]  # the last level's phases
        spans: list[list[Any]] = []
        for t0, phase, _ in shaded["samples"]:
            if spans and spans[-1][2] == phase:
                spans[-1][1] = t0
            else:
                spans.append([t0, t0, phase])
        for t0, t1, phase in spans:
            if phase in colors:
                ax.axvspan(t0, t1, color=colors[phase], alpha=0.15, lw=0)
        ax.set_title(f"{task}: memory over the pre-training baseline (shading: phases of the "
                     f"{shaded['level']} run)", fontsize=12)  # fmt: skip
        ax.set_xlabel("seconds", fontsize=11)
        ax.set_ylabel("MiB", fontsize=11)
        ax.legend(fontsize=10, loc="upper right")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in colors.values()][:4]
    fig.legend(handles, PHASES, loc="lower center", ncol=4, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--tasks", default="mnist,char-gpt")
    p.add_argument("--levels", default="L0,L1,L2")
    p.add_argument("--steps", type=int, default=3, help="training steps (the first compiles)")
    p.add_argument("--interval", type=float, default=0.002)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", default=None, help="torch.compile backend (inductor, aot_eager)")
    p.add_argument("--json", default="memory_breakdown.json")
    p.add_argument("--out", default="memory_breakdown.png")
    p.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc's malloc as a user's process has it (peaks then include what it keeps)",
    )
    p.add_argument("--one", nargs=2, metavar=("TASK", "LEVEL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:
        if not args.default_malloc:
            tune_malloc_for_measurement()
        print(json.dumps(measure(args.one[0], args.one[1], args)))
        return
    records = []
    for task in args.tasks.split(","):
        for level in args.levels.split(","):
            cmd = [sys.executable, __file__, *(argv or sys.argv[1:]), "--one", task, level]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            records.append(json.loads(out.strip().splitlines()[-1]))
            print(f"{task} {level}: peak +{records[-1]['peak_bytes'] / (1 << 20):.0f} MiB")
    Path(args.json).write_text(json.dumps(records))
    print(table(records))
    plot(records, Path(args.out))


if __name__ == "__main__":
    main()
