"""Character-level GPT on tiny-shakespeare; reports the validation loss (nats per character).

    python examples/text/train_char_gpt.py --data DATA
    python examples/text/train_char_gpt.py --data DATA --gact --level L2

DATA is the folder holding ``tinyshakespeare/input.txt``, or ``tinyshakespeare/`` itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from gact_examples.data import load_char_corpus
from gact_examples.models import CharGPT
from gact_examples.train import Run, base_parser, check_args, finish, setup


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0], epochs=1, batch_size=32)
    p.add_argument("--steps-per-epoch", type=int, default=300)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--eval-batches", type=int, default=20, help="validation batches (fixed)")
    args = p.parse_args(argv)
    check_args(p, args, needs_data=True)
    return args


def sample_batch(
    ids: torch.Tensor, starts: torch.Tensor, block: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-character targets of the windows starting at ``starts``."""
    offs = torch.arange(block + 1)
    chunk = ids[starts.unsqueeze(1) + offs]  # B x (block+1)
    return chunk[:, :-1].to(device), chunk[:, 1:].to(device)


@torch.no_grad()
def evaluate(
    model: CharGPT, val_ids: torch.Tensor, args: argparse.Namespace, device: torch.device
) -> float:
    """Mean loss over a fixed set of validation windows (same windows at every level/seed)."""
    model.eval()
    gen = torch.Generator().manual_seed(4321)
    hi = len(val_ids) - args.block_size - 1
    losses = []
    for _ in range(args.eval_batches):
        starts = torch.randint(0, hi, (args.batch_size,), generator=gen)
        x, y = sample_batch(val_ids, starts, args.block_size, device)
        losses.append(float(model(x, y)[1]))
    return float(np.mean(losses))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = setup(args)
    corpus = load_char_corpus(args.data)
    train_ids = torch.from_numpy(corpus["train"])
    val_ids = torch.from_numpy(corpus["val"])
    if min(len(val_ids), len(train_ids)) <= args.block_size + 1:
        raise ValueError(
            f"the corpus' validation part has {len(val_ids)} characters, too few for "
            f"--block-size {args.block_size}; use a smaller --block-size"
        )
    model = CharGPT(
        len(corpus["chars"]), args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout
    ).to(device)
    lr = args.lr or 3e-3
    total = args.mem_steps if args.get_mem else args.epochs * args.steps_per_epoch
    gen = torch.Generator().manual_seed(args.seed)
    hi = len(train_ids) - args.block_size - 1

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, hi, (args.batch_size,), generator=gen)
        return sample_batch(train_ids, starts, args.block_size, device)

    with Run(args, model, device) as run:
        run.train_steps(
            next_batch,
            lambda batch: model(*batch)[1],
            lr=lr,
            total=total,
            steps_per_epoch=args.steps_per_epoch,
            desc=f"char-gpt {run.level}",
        )

    val = None if args.get_mem else evaluate(model, val_ids, args, device)
    rec = run.result(
        model=f"char-gpt-L{args.n_layer}-d{args.n_embd}",
        dataset="tinyshakespeare",
        metric="val_loss",
        final_metric=val,
        item_unit="tokens",
        items_per_step=args.batch_size * args.block_size,
        batch_size=args.batch_size,
        block_size=args.block_size,
        steps_per_epoch=args.steps_per_epoch,
        lr=lr,
    )
    return finish(args, run, rec)


if __name__ == "__main__":
    main()
