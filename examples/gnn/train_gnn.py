"""Full-batch node classification on Cora (Planetoid split) with GCN, GraphSAGE or GAT.

    python examples/gnn/train_gnn.py --data DATA --model gcn
    python examples/gnn/train_gnn.py --data DATA --model gat --gact --level L2
    python examples/gnn/train_gnn.py --data DATA --model sage --gact --level L2 --get-mem

DATA is the folder holding ``cora/`` (``ind.cora.*``), or ``cora/`` itself. The reported metric
is the test accuracy at the epoch of lowest validation loss
(:func:`gact_examples.train.selected_epoch`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from gact_examples.data import load_planetoid
from gact_examples.models import GNN, Graph
from gact_examples.train import (
    Run,
    base_parser,
    check_args,
    finish,
    progress,
    selected_epoch,
    setup,
)

DEFAULTS = {  # hidden size, learning rate, weight decay
    "gcn": (64, 0.01, 5e-4),
    "sage": (64, 0.01, 5e-4),
    "gat": (64, 0.005, 5e-4),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0], epochs=200)
    p.add_argument("--model", choices=sorted(DEFAULTS), default="gcn")
    p.add_argument("--dataset", default="cora", help="Planetoid dataset name (files ind.NAME.*)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument(
        "--init-noise",
        type=float,
        default=0.0,
        metavar="EPS",
        help="multiply every initial weight by 1 + EPS * N(0, 1) (a control for how much the "
        "metric moves under a perturbation that is not compression; see BENCHMARKS.md)",
    )
    p.add_argument("--noise-seed", type=int, default=0, help="seed of the --init-noise draw")
    args = p.parse_args(argv)
    check_args(p, args, needs_data=True)
    if not 0.0 <= args.init_noise < 1.0:
        p.error(f"--init-noise must be in [0, 1), got {args.init_noise}")
    return args


def perturb_(model: torch.nn.Module, eps: float, seed: int) -> None:
    """Multiply every parameter by ``1 + eps * N(0, 1)``, drawn from a generator of ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + eps * torch.randn(p.shape, generator=gen).to(p.device))


@torch.no_grad()
def evaluate(
    model: GNN,
    x: torch.Tensor,
    graph: Graph,
    aux: torch.Tensor,
    y: torch.Tensor,
    idx_sets: Sequence[torch.Tensor],
) -> list[float]:
    """Validation loss on ``idx_sets[0]``, then the accuracy on each index set."""
    model.eval()
    out = model(x, graph, aux)
    pred = out.argmax(1)
    val = idx_sets[0]
    return [float(F.cross_entropy(out[val], y[val]))] + [
        float((pred[i] == y[i]).float().mean()) for i in idx_sets
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = setup(args)
    data = load_planetoid(args.data, args.dataset)
    hidden, lr, wd = DEFAULTS[args.model]
    hidden = args.hidden or hidden
    lr = args.lr or lr

    x = torch.from_numpy(data["x"]).to(device)
    y = torch.from_numpy(data["y"]).to(device)
    train_idx, val_idx, test_idx = (
        torch.from_numpy(data[k]).to(device) for k in ("train_idx", "val_idx", "test_idx")
    )
    edge_index = torch.from_numpy(data["edge_index"]).to(device)
    graph, aux = GNN.prepare(args.model, edge_index, x.shape[0])
    model = GNN(args.model, x.shape[1], hidden, int(data["num_classes"]), args.dropout).to(device)
    if args.init_noise:
        perturb_(model, args.init_noise, seed=args.noise_seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd)

    def closure() -> torch.Tensor:
        model.train()
        out = model(x, graph, aux)
        loss = F.cross_entropy(out[train_idx], y[train_idx])
        optimizer.zero_grad()
        loss.backward()
        return loss

    steps = args.mem_steps if args.get_mem else args.epochs
    best_val_acc, test_at_best_val_acc = -1.0, None
    with Run(args, model, device) as run:
        bar = progress(range(steps), args, desc=f"{args.model} {run.level}")
        for epoch in bar:
            loss = run.step(closure)
            optimizer.step()
            if args.get_mem:
                continue
            val_loss, val_acc, test_acc = evaluate(model, x, graph, aux, y, (val_idx, test_idx))
            if val_acc > best_val_acc:
                best_val_acc, test_at_best_val_acc = val_acc, test_acc
            run.log_epoch(
                epoch=epoch, loss=float(loss), val_loss=val_loss, val_acc=val_acc, test_acc=test_acc
            )
            bar.set_postfix(loss=f"{float(loss):.3f}", val=f"{val_acc:.3f}")

    chosen = (
        run.history[selected_epoch([h["val_loss"] for h in run.history])] if run.history else {}
    )
    rec = run.result(
        model=args.model,
        dataset=args.dataset,
        metric="test_accuracy",
        final_metric=chosen.get("test_acc"),
        item_unit="nodes",
        items_per_step=x.shape[0],
        selected_epoch=chosen.get("epoch"),
        best_val_loss=chosen.get("val_loss"),
        test_at_best_val_accuracy=test_at_best_val_acc,
        best_val_accuracy=None if args.get_mem else best_val_acc,
        last_test_accuracy=run.history[-1]["test_acc"] if run.history else None,
        selection="test accuracy at the epoch of lowest validation loss (earliest on ties)",
        init_noise=args.init_noise,
        noise_seed=args.noise_seed if args.init_noise else None,
        hidden=hidden,
        lr=lr,
    )
    return finish(args, run, rec)


if __name__ == "__main__":
    main()
