"""What one training step stores when saves are views of other saves (NOTE [Aliased saves]).

An activation that saves its output (ReLU, tanh) on a tokens-by-features batch is read again by the
next linear layer through a 2-D view of it, and an attention's output by the output projection's
view of it: PyTorch holds each such storage once. For PyTorch's own ``nn.TransformerEncoder`` (ReLU
or GELU, with and without dropout), a tanh MLP on tokens and ``transformers``' GPT-2 (fused
attention; and eager, without dropout) and BERT (eager, without dropout), built small with random
weights, this prints per level the bytes GACT stores, the bytes autograd would hold without it, and
the saves stored as an earlier save. Run it at two commits to compare them.

    python examples/view_saves.py --levels L1,L2 --json view_saves.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from gact import Controller, GactConfig
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
    """One training step of model ``name`` at ``level``: its saved-activation statistics."""
    torch.manual_seed(args.seed)
    model = MODELS[name](args.width)
    model.train()
    if name in ("gpt2", "gpt2-eager", "bert-eager"):
        ids = torch.randint(0, 256, (args.batch, args.tokens))
        step: Callable[[], torch.Tensor] = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    else:
        x = torch.randn(args.batch, args.tokens, args.width)
        step = lambda: model(x).square().mean()  # noqa: E731
    with Controller(model, GactConfig.from_level(level)) as controller:
        step().backward()
        controller.step()
    stats = controller.stats()
    return {
        "model": name,
        "level": level,
        "stored_bytes": stats["stored_bytes"],
        "original_bytes": stats["original_bytes"],
        "deduplicated_saves": stats["deduplicated_saves"],
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--levels", default="L1")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        p.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    if args.width % 8:
        p.error(f"--width must be a multiple of the 8 attention heads, got {args.width}")
    records = [measure(name, level, args) for name in names for level in args.levels.split(",")]
    print("| model | level | stored (MB) | autograd would hold (MB) | saves stored as another |")
    print("|---|---|---|---|---|")
    for r in records:
        print(f"| {r['model']} | {r['level']} | {r['stored_bytes'] / 1e6:.3f} | "
              f"{r['original_bytes'] / 1e6:.3f} | {r['deduplicated_saves']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
