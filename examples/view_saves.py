"""What one training step stores when saves are views of other saves (NOTE [Aliased saves]).

An activation that saves its output (ReLU, tanh) on a tokens-by-features batch is read again by the
next linear layer through a 2-D view of it, and an attention's output by the output projection's
view of it: PyTorch holds each such storage once. For PyTorch's own ``nn.TransformerEncoder`` (ReLU
or GELU, with and without dropout), a tanh MLP on tokens and ``transformers``' GPT-2 (fused
attention; and eager, without dropout) and BERT (eager, without dropout), built small with random
weights, this prints per level the bytes GACT stores, the bytes autograd would hold without it, and
the saves stored as an earlier save. Run it at two commits to compare them.

    python examples/view_saves.py --levels L1,L2 --json view_saves.json
    python examples/view_saves.py --models encoder-relu --levels fp32,L1 --steps 6 --fresh \
        --malloc default   # and tuned: the peak resident size a process sees
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from gact import Controller, GactConfig
from gact_examples.memory import tune_malloc_for_measurement
from torch import nn


def _encoder(activation: str, dropout: float, width: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(
        width, 8, 4 * width, dropout=dropout, activation=activation, batch_first=True
    )
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _gpt2(width: int, eager: bool = False) -> nn.Module:
    """2 layers; ``eager``: attention in plain ops (``attn_implementation="eager"``), no
    dropout, so the softmax's output is the saved base of the product's view of it."""
    import transformers

    no_dropout = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0} if eager else {}
    config = transformers.GPT2Config(
        vocab_size=256, n_embd=width, n_layer=2, n_head=8, n_positions=1024, **no_dropout,
        attn_implementation="eager" if eager else "sdpa",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _bert_eager(width: int) -> nn.Module:
    """2 layers, attention in plain ops, no dropout (as ``_gpt2(eager=True)``)."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=256, hidden_size=width, num_hidden_layers=2, num_attention_heads=8,
        intermediate_size=4 * width, max_position_embeddings=1024, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


MODELS: dict[str, Callable[[int], nn.Module]] = {
    "encoder-relu": lambda w: _encoder("relu", 0.0, w),
    "encoder-gelu": lambda w: _encoder("gelu", 0.0, w),
    "encoder-relu-dropout": lambda w: _encoder("relu", 0.1, w),
    "tanh-mlp": lambda w: nn.Sequential(nn.Linear(w, 4 * w), nn.Tanh(), nn.Linear(4 * w, w)),
    "gpt2": _gpt2,
    "gpt2-eager": lambda w: _gpt2(w, eager=True),
    "bert-eager": _bert_eager,
}


def measure(name: str, level: str, args: argparse.Namespace) -> dict[str, Any]:
    """``args.steps`` AdamW steps of model ``name`` at ``level`` (``fp32``: without GACT): its
    saved-activation statistics and the growth of the process's peak resident size over the
    steps (the figure a user sees only in a fresh process: ``--fresh``)."""
    torch.manual_seed(args.seed)
    model = MODELS[name](args.width)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name in ("gpt2", "gpt2-eager", "bert-eager"):
        ids = torch.randint(0, 256, (args.batch, args.tokens))
        loss: Callable[[], torch.Tensor] = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    else:
        x = torch.randn(args.batch, args.tokens, args.width)
        loss = lambda: model(x).square().mean()  # noqa: E731
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    config = None if level == "fp32" else GactConfig.from_level(level)
    controller = None if config is None else Controller(model, config)
    with contextlib.nullcontext() if controller is None else controller:
        for _ in range(args.steps):
            optimizer.zero_grad()
            loss().backward()
            optimizer.step()
            if controller is not None:
                controller.step()
    stats = {} if controller is None else controller.stats()
    return {
        "model": name,
        "level": level,
        "stored_bytes": stats.get("stored_bytes", 0),
        "original_bytes": stats.get("original_bytes", 0),
        "deduplicated_saves": stats.get("deduplicated_saves", 0),
        "peak_rss_growth_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
        "malloc": args.malloc,
    }


def _fresh(name: str, level: str, argv: Sequence[str]) -> dict[str, Any]:
    """``measure`` in a fresh Python process (``argv``: this run's options)."""
    command = [sys.executable, __file__, *argv, "--one", name, level]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--levels", default="L1")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1, help="AdamW training steps")
    p.add_argument(
        "--fresh", action="store_true",
        help="each model and level in a fresh process, so that its peak resident size counts",
    )  # fmt: skip
    p.add_argument(
        "--malloc", choices=("default", "tuned"), default="default",
        help="glibc's malloc as it is, or tuned so that the resident size follows live memory "
        "(gact_examples.memory.tune_malloc_for_measurement)",
    )  # fmt: skip
    p.add_argument("--json", default=None)
    p.add_argument("--one", nargs=2, metavar=("MODEL", "LEVEL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.one:  # a fresh process's measurement, as one JSON line
        if args.malloc == "tuned":
            tune_malloc_for_measurement()
        print(json.dumps(measure(*args.one, args)))
        return []
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        p.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    if args.width % 8:
        p.error(f"--width must be a multiple of the 8 attention heads, got {args.width}")
    forwarded = list(argv if argv is not None else sys.argv[1:])
    records = [
        _fresh(name, level, forwarded) if args.fresh else measure(name, level, args)
        for name in names
        for level in args.levels.split(",")
    ]
    print("| model | level | stored (MB) | autograd would hold (MB) | saves stored as another "
          "| peak RSS growth (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in records:
        rss = f"{r['peak_rss_growth_bytes'] / 2**20:.1f}" if args.fresh else "-"
        print(f"| {r['model']} | {r['level']} | {r['stored_bytes'] / 1e6:.3f} | "
              f"{r['original_bytes'] / 1e6:.3f} | {r['deduplicated_saves']} | {rss} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
