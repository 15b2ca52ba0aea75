"""A small BERT classifies tiny-shakespeare passages by the part of the corpus they come from.

    python examples/hf/train_bert_classifier.py --data DATA
    python examples/hf/train_bert_classifier.py --data DATA --gact --level L2

DATA is the folder holding ``tinyshakespeare/input.txt``, or ``tinyshakespeare/`` itself. The
model is ``transformers.BertForSequenceClassification`` built from a ``BertConfig`` (random
weights, a word vocabulary plus a ``[CLS]`` token; nothing is downloaded); the task is
:func:`gact_examples.data.load_passage_classes` (which of ``--classes`` equal parts of the
corpus a passage of words comes from: the corpus is a run of plays, so the parts differ in
characters' names and subject). The metric is the accuracy on the held-out chunks. This is the held-out
transformer-classification check of the adaptive levels (BENCHMARKS.md); it needs
``pip install "./examples[transformers]"``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from gact_examples.data import load_passage_classes
from gact_examples.models import bert_classifier, passages, with_cls
from gact_examples.train import Run, base_parser, check_args, finish, setup


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0], epochs=1, batch_size=32)
    p.add_argument("--steps-per-epoch", type=int, default=400)
    p.add_argument("--classes", type=int, default=8, help="parts of the corpus to tell apart")
    p.add_argument("--passage", type=int, default=32, help="words per passage")
    p.add_argument("--chunk", type=int, default=512, help="words per chunk (see the task)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    args = p.parse_args(argv)
    check_args(p, args, needs_data=True)
    if args.classes < 2 or not 1 <= args.passage <= args.chunk:
        p.error("--classes must be at least 2 and --passage in [1, --chunk]")
    return args


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over every held-out passage."""
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(x), batch_size):
        logits = model(input_ids=x[i : i + batch_size]).logits
        loss += float(F.cross_entropy(logits, y[i : i + batch_size], reduction="sum"))
        correct += int((logits.argmax(1) == y[i : i + batch_size]).sum())
    return loss / len(x), correct / len(x)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = setup(args)
    task = load_passage_classes(
        args.data, classes=args.classes, passage=args.passage, chunk=args.chunk
    )
    cls = len(task["vocab"])
    test_x = with_cls(torch.from_numpy(task["test_x"]), cls).to(device)
    test_y = torch.from_numpy(task["test_y"]).to(device)
    ids = torch.from_numpy(task["ids"])
    train_starts = torch.from_numpy(task["train_starts"])
    train_y = torch.from_numpy(task["train_y"])
    model = bert_classifier(
        cls,
        args.classes,
        length=args.passage,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    ).to(device)
    lr = args.lr or 1e-3
    total = args.mem_steps if args.get_mem else args.epochs * args.steps_per_epoch
    gen = torch.Generator().manual_seed(args.seed)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        pick = torch.randint(0, len(train_starts), (args.batch_size,), generator=gen)
        xb = passages(ids, train_starts[pick], args.passage, cls).to(device)
        return xb, train_y[pick].to(device)

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(input_ids=batch[0]).logits, batch[1])

    with Run(args, model, device) as run:
        run.train_steps(
            next_batch,
            loss_of,
            lr=lr,
            total=total,
            steps_per_epoch=args.steps_per_epoch,
            desc=f"bert {run.level}",
        )

    test_loss, test_acc = (None, None) if args.get_mem else evaluate(model, test_x, test_y, 256)
    rec = run.result(
        model=f"bert-L{args.n_layer}-d{args.n_embd}",
        dataset=f"tinyshakespeare-{args.classes}-parts",
        metric="test_accuracy",
        final_metric=test_acc,
        item_unit="passages",
        items_per_step=args.batch_size,
        test_loss=test_loss,
        test_passages=len(test_y),
        batch_size=args.batch_size,
        passage=args.passage,
        steps_per_epoch=args.steps_per_epoch,
        lr=lr,
    )
    return finish(args, run, rec)


if __name__ == "__main__":
    main()
