"""Which group layout rounds a linear layer's input best: memory order or feature groups.

After ``--warmup`` fp32 training steps of the stability study's LLaMA-style decoder or ViT,
one batch's inputs and output gradients of every ``nn.Linear`` are captured, and each input
alone is rounded (``--draws`` seeds, 2 and 4 bits) in four layouts:

- groups of 256 in memory order (the original GACT's, and this project's for rank 2-3 saves
  before NOTE [Feature groups] in gact/storing.py);
- groups of 64 in memory order (a quarter of the group: four times the metadata);
- feature groups: 256 rows of one feature per group (``channel_dim`` = the last dimension);
- groups that never span two rows (``channel_dim=0``).

For each it prints the weight gradient's squared rounding error ``E |g^T (x^ - x)|^2`` over the
exact gradient's squared norm.

    python examples/group_layouts.py --data DATA --model llama --json layouts.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import gact_kernels
import torch
from gact_examples.tasks import make_task, warmed_up
from torch import nn

#: layout name -> keyword arguments of ``gact_kernels.quantize``
LAYOUTS: dict[str, dict[str, Any]] = {
    "memory order, 256": {},
    "memory order, 64": {"group_size": 64},
    "feature groups": {"channel_dim": 1},
    "row groups": {"channel_dim": 0},
}


def capture(model: nn.Module, loss: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every linear layer's input and output gradient (as rows) of one backward of ``loss()``."""
    inputs: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def forward(m: nn.Module, args: Any, out: Any, name: str = name) -> None:
                inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1]).contiguous()

            def backward(m: nn.Module, gin: Any, gout: Any, name: str = name) -> None:
                grads[name] = gout[0].detach().reshape(-1, gout[0].shape[-1])

            handles += [module.register_forward_hook(forward)]
            handles += [module.register_full_backward_hook(backward)]
    model.zero_grad()
    loss().backward()
    for handle in handles:
        handle.remove()
    return {name: (inputs[name], grads[name]) for name in inputs}


def relative_error(x: torch.Tensor, g: torch.Tensor, bits: int, draws: int, **layout: Any) -> float:
    """``E |g^T (x^ - x)|^2 / |g^T x|^2`` over ``draws`` rounding seeds of ``x`` alone."""
    total = 0.0
    for seed in range(draws):
        rounded = gact_kernels.dequantize(gact_kernels.quantize(x, bits, seed=seed, **layout))
        total += float((g.t() @ (rounded - x)).pow(2).sum())
    return total / draws / float((g.t() @ x).pow(2).sum())


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--model", choices=("llama", "vit"), default="llama")
    p.add_argument("--warmup", type=int, default=300, help="fp32 training steps first")
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    task = make_task(args.model, args)
    model, batches = warmed_up(task, args.warmup)
    batch = next(batches)
    rows = []
    print(f"| {args.model} layer | input | bits | " + " | ".join(LAYOUTS) + " |")
    print("|---|---|---|" + "---:|" * len(LAYOUTS))
    for name, (x, g) in capture(model, lambda: task.loss(model, batch)).items():
        for bits in (2, 4):
            errors = {k: relative_error(x, g, bits, args.draws, **v) for k, v in LAYOUTS.items()}
            rows.append({"layer": name, "shape": list(x.shape), "bits": bits, **errors})
            cells = " | ".join(f"{e:.2e}" for e in errors.values())
            print(f"| {name} | {tuple(x.shape)} | {bits} | {cells} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
