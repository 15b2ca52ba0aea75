"""Does compression make training less stable? Models trained the way their users train them,
near the edge of fp32's stable learning rates, at every level and seed.

- ``resnet18``: torchvision's ResNet-18 layout (``gact_examples.models.ResNet18``) on ``--images``
  CIFAR-10 training images (a fixed random subset, 32x32), SGD with momentum 0.9.
- ``vit``, ``llama``: the model matrix's ViT (CIFAR-10 images, 4x4 patches) and LLaMA-style
  decoder (RMSNorm, SiLU-gated MLP, rotary embeddings; tiny-shakespeare characters, 64 per
  sequence), from the same ``transformers`` configs (2 layers of width 64), AdamW.

The record of each run says whether and when the loss became NaN, its final loss (mean of the
last ``--tail`` steps) and its largest gradient norm. With ``--variance-steps``, the runs of
``--variance-levels`` (L1 by default) also measure, at those steps and per parameter, the
variance that rounding adds to the gradient over the minibatch variance (the premise of GACT's
analysis: it should be small; an adaptive level's runs round with their own allocation of the
moment), and with ``--channel-error-steps`` each 4-D save's worst per-channel rounding error at
4 bits in both group layouts (what BatchNorm divides by the channel's spread). ``--layout
memory`` groups in memory order, as the original GACT did (``GactConfig(channel_groups=False)``).
The adaptive levels' runs are reproducible only with ``--adapt-budget none``: their default
time budget reads the clock (NOTE [Adaptation schedule] in gact_policy).

    python examples/stability.py --data DATA --model resnet18 --lrs 0.05,0.1 --seeds 0,1,2 \
        --levels L0,L1,L2,L1.2,L2.2 --steps 300 --variance-steps 0,100,200,299
    python examples/stability.py --data DATA --model llama --lrs 1e-3 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gact_kernels
import torch
from gact import Controller, GactConfig
from gact_examples.tasks import Batch, Task, make_task
from torch import nn


def _grads(model: nn.Module, task: Task, batch: Batch) -> dict[str, torch.Tensor]:
    model.zero_grad()
    task.loss(model, batch).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _spread(samples: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Per parameter, the summed variance of the samples (unbiased)."""
    out = {}
    for name in samples[0]:
        stack = torch.stack([s[name] for s in samples]).double()
        out[name] = float(stack.var(0, unbiased=True).sum())
    return out


def variance_ratios(
    model: nn.Module,
    task: Task,
    config: GactConfig,
    draws: int,
    seed: int,
    *,
    minibatches: int = 32,
    rounding_batches: int = 4,
    bits: dict[str, int] | None = None,
) -> dict[str, float]:
    """Per parameter, the quantization variance of the gradient at ``config`` (over ``draws``
    rounding seeds on a batch, averaged over ``rounding_batches`` batches) over the minibatch
    variance (fp32, over ``minibatches`` batches of the same size), both at the model's current
    weights, in train mode. Parameters whose minibatch variance is below 1e-12 of the largest (a
    gradient identically zero) are left out. ``bits``: an adaptive level's allocation (its
    ``plan.bits``), which the rounding then uses instead of the level's first-step widths.

    Some parameters' minibatch gradients are heavy-tailed (a few batches make most of their
    spread), and a handful of batches then usually underestimates their variance: on the
    ResNet-18 layout at lr 0.1, 8 batches gave a layer1 BatchNorm weight 0.17x the variance 32
    gave, and a ratio of 10.7% where 32 batches and 6 rounding batches gave 0.0-1.8%
    (BENCHMARKS.md, "Stability"). The rounding variance also moves with the batch rounded, by
    about 4x across batches there."""
    probe = copy.deepcopy(model)  # BatchNorm's running statistics move on the copy only
    probe.train()
    batches = task.batches(torch.Generator().manual_seed(10_000 + seed))
    minibatch = _spread([_grads(probe, task, next(batches)) for _ in range(minibatches)])
    rounding: dict[str, float] = {}
    for _ in range(rounding_batches):
        batch = next(batches)
        rounded = []
        for r in range(draws):
            with Controller(probe, config.replace(seed=1000 * seed + r)) as controller:
                if bits is not None:
                    controller.plan.bits = dict(bits)
                rounded.append(_grads(probe, task, batch))
        for name, value in _spread(rounded).items():
            rounding[name] = rounding.get(name, 0.0) + value / rounding_batches
    # a gradient that is zero whatever the batch (the bias of a key projection: softmax ignores
    # a shift of a query's scores) has no minibatch variance to compare with
    floor = 1e-12 * max(minibatch.values())
    return {n: rounding[n] / minibatch[n] for n in minibatch if minibatch[n] > floor}


def channel_errors(model: nn.Module, task: Task, batch: Batch, bits: int) -> list[dict[str, Any]]:
    """For every float save of rank 4 or more in one forward: the worst channel's rounding error
    at ``bits`` over that channel's standard deviation (the error BatchNorm divides by it), in
    memory-order groups and in channel groups, one rounding seed."""
    saves: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 4 and t.dtype.is_floating_point and not isinstance(t, nn.Parameter):
            saves.append(t.detach().clone())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        task.loss(copy.deepcopy(model), batch)
    rows = []
    for index, t in enumerate(saves):
        dims = [d for d in range(t.dim()) if d != 1]
        spread = t.float().std(dims).clamp_min(1e-12)
        row: dict[str, Any] = {"index": index, "shape": list(t.shape)}
        for name, channel_dim in (("memory", None), ("channel", 1)):
            q = gact_kernels.quantize(t, bits, seed=index, channel_dim=channel_dim)
            err = (gact_kernels.dequantize(q) - t).float().pow(2).mean(dims).sqrt() / spread
            row[name] = float(err.max())
        rows.append(row)
    return rows


def train(task: Task, level: str, seed: int, lr: float, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = task.build()
    model.train()
    optimizer = task.optimizer(model, lr)
    batches = task.batches(torch.Generator().manual_seed(seed))
    config = GactConfig.from_level(
        level, seed=seed, channel_groups=args.layout == "channel",
        rotated_groups=args.rotation == "on",
    )  # fmt: skip
    if hasattr(args, "adapt_budget"):  # given: a fraction, or None for no time budget
        config = config.replace(adapt_budget=args.adapt_budget)
    controller = Controller(model, config)
    measured = level in args.variance_levels.split(",")
    probe_at = {int(s) for s in args.variance_steps.split(",") if s} if measured else set()
    errors_at = (
        {int(s) for s in args.channel_error_steps.split(",") if s} if level == "L1" else set()
    )
    losses: list[float] = []
    grad_norms: list[float] = []
    ratios: dict[int, dict[str, float]] = {}
    errors: dict[int, list[dict[str, Any]]] = {}
    first_nan = None
    with controller:
        for step in range(args.steps):
            batch = next(batches)
            if step in probe_at:
                with controller.paused():
                    ratios[step] = variance_ratios(
                        model, task, config, args.variance_draws, seed,
                        minibatches=args.minibatch_draws, rounding_batches=args.rounding_batches,
                        bits=dict(controller.plan.bits) if config.spec.adaptive else None,
                    )  # fmt: skip
            if step in errors_at:
                with controller.paused():
                    errors[step] = channel_errors(model, task, batch, 4)

            def closure(batch: Batch = batch) -> torch.Tensor:
                loss = task.loss(model, batch)
                optimizer.zero_grad()
                loss.backward()
                return loss

            loss = float(controller.iterate(closure).detach())
            norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
            grad_norms.append(float(torch.linalg.vector_norm(torch.stack(norms))))
            optimizer.step()
            losses.append(loss)
            if not math.isfinite(loss):
                first_nan = step
                break
    tail = losses[-args.tail :]
    stats = controller.stats()
    return {
        "model": args.model,
        "level": level,
        "seed": seed,
        "lr": lr,
        "layout": args.layout,
        "rotation": args.rotation,
        "steps": args.steps,
        "first_nan_step": first_nan,
        "final_loss": statistics.fmean(tail) if first_nan is None else math.nan,
        "max_grad_norm": max(grad_norms),
        "losses": losses,
        "grad_norms": grad_norms,
        "variance_ratios": ratios,
        "variance_estimate": {
            "rounding_seeds": args.variance_draws,
            "minibatches": args.minibatch_draws,
            "rounding_batches": args.rounding_batches,
        },
        "channel_errors": errors,
        "ratio": stats["ratio"],
        "adapt_budget": config.adapt_budget,
        "adaptations": stats["adaptations"],
        "adaptation_overhead": stats["adaptation_overhead"],
    }


def _budget(text: str) -> float | None:
    """``--adapt-budget``: a fraction >= 0, or ``None`` for ``none``."""
    if text == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"a fraction >= 0 or 'none', got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--model", choices=("resnet18", "vit", "llama"), default="resnet18")
    p.add_argument("--levels", default="L0,L1,L2,L1.2,L2.2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lrs", default="0.05,0.1", help="learning rates (SGD for resnet18, AdamW)")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--tail", type=int, default=20, help="final loss: mean of the last N steps")
    p.add_argument(
        "--layout", choices=("channel", "memory"), default="channel",
        help="GactConfig.channel_groups on (channel) or off (memory order, the original's)",
    )  # fmt: skip
    p.add_argument(
        "--rotation", choices=("on", "off"), default="on",
        help="GactConfig.rotated_groups (NOTE [Rotated groups] in gact/rotation.py)",
    )  # fmt: skip
    p.add_argument(
        "--variance-steps", default="",
        help="steps at which the --variance-levels runs measure quantization / minibatch "
        "variance per parameter",
    )  # fmt: skip
    p.add_argument(
        "--variance-levels", default="L1",
        help="levels whose runs measure variance (adaptive ones with their own allocation)",
    )  # fmt: skip
    p.add_argument("--variance-draws", type=int, default=8, help="rounding seeds per batch")
    p.add_argument(
        "--minibatch-draws", type=int, default=32,
        help="batches whose fp32 gradients give the minibatch variance",
    )  # fmt: skip
    p.add_argument(
        "--rounding-batches", type=int, default=4,
        help="batches whose rounding variance is averaged",
    )  # fmt: skip
    p.add_argument(
        "--channel-error-steps", default="",
        help="steps at which L1 runs record each 4-D save's worst per-channel rounding error",
    )  # fmt: skip
    p.add_argument(
        "--adapt-budget", type=_budget, default=argparse.SUPPRESS,
        help="GactConfig.adapt_budget of the adaptive levels ('none': no time budget, so runs "
        "are reproducible; default: the config's)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="stability.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    task = make_task(args.model, args)
    records = []
    for lr in (float(v) for v in args.lrs.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            for level in args.levels.split(","):
                rec = train(task, level, seed, lr, args)
                records.append(rec)
                Path(args.out).write_text(json.dumps(records))
                print(f"{args.model} lr {lr} seed {seed} {level}: first NaN at "
                      f"{rec['first_nan_step']}, final loss {rec['final_loss']:.3f}, max grad "
                      f"norm {rec['max_grad_norm']:.1f}", flush=True)  # fmt: skip
    return records


if __name__ == "__main__":
    main()
