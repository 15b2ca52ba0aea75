"""Cora node classification with PyTorch Geometric's GCN, GraphSAGE and GAT, fp32 against a GACT
level: test accuracy over seeds, and the saved-activation ratio.

    python examples/pyg/cora_fidelity.py --data DATA --out cora.json
    python examples/pyg/cora_fidelity.py --data DATA --models gcn --seeds 0,1,2,3,4 --level L2.2

DATA is the folder holding ``cora/`` (the Planetoid files ``ind.cora.*``), or ``cora/`` itself;
nothing is downloaded. The split is Planetoid's public one (140 training, 500 validation and
1000 test nodes). Each seed trains both runs from the same initial weights with the same dropout
masks (GACT's probes restore the RNG), and reports the test accuracy at the epoch of lowest
validation loss (:func:`gact_examples.train.selected_epoch`; the epoch of best validation
accuracy is recorded too). Needs ``torch-geometric`` (``pip install "gact-runtime[pyg]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gact import LEVELS, Controller, GactConfig
from gact_examples.train import selected_epoch
from torch import nn
from torch_geometric.data import Data
from torch_geometric.io import read_planetoid_data
from torch_geometric.nn import GAT, GCN, GraphSAGE

# Model, hidden width, dropout, learning rate (weight decay 5e-4 for all): the usual Cora settings
# (Kipf & Welling's GCN, Velickovic et al.'s GAT with 8 heads of 8).
MODELS: dict[str, tuple[type[nn.Module], dict[str, Any], float]] = {
    "gcn": (GCN, {"hidden_channels": 16, "dropout": 0.5}, 0.01),
    "sage": (GraphSAGE, {"hidden_channels": 64, "dropout": 0.5}, 0.01),
    "gat": (GAT, {"hidden_channels": 64, "heads": 8, "dropout": 0.6}, 0.005),
}
WEIGHT_DECAY = 5e-4
TOLERANCE = 0.5  # accuracy points


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True, help="folder holding cora/ (or cora/)")
    p.add_argument("--models", default="gcn,sage,gat", help="comma-separated: gcn, sage, gat")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument(
        "--level", default="L2", choices=[n for n, lv in LEVELS.items() if lv.compresses]
    )
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out", type=Path, default=Path("cora_fidelity.json"), help="JSON results")
    args = p.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown model(s) {sorted(unknown)}; choose from {sorted(MODELS)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    return args


def load_cora(data: Path) -> Data:
    """Cora from the local Planetoid files, features row-normalised (as in Kipf & Welling)."""
    folder = data if (data / "ind.cora.x").is_file() else data / "cora"
    if not (folder / "ind.cora.x").is_file():
        raise FileNotFoundError(f"no Planetoid files ind.cora.* in {data} or {data / 'cora'}")
    graph = read_planetoid_data(str(folder), "cora")
    graph.x = graph.x / graph.x.sum(dim=1, keepdim=True).clamp(min=1)
    return graph


def train(graph: Data, model_name: str, seed: int, level: str | None, epochs: int) -> dict:
    """One run; ``level=None`` is plain fp32 training without GACT."""
    cls, options, lr = MODELS[model_name]
    torch.manual_seed(seed)
    num_classes = int(graph.y.max()) + 1
    model = cls(graph.num_features, num_layers=2, out_channels=num_classes, **options)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    controller = None if level is None else Controller(model, GactConfig.from_level(level))

    def closure() -> torch.Tensor:
        model.train()
        out = model(graph.x, graph.edge_index)
        loss = F.cross_entropy(out[graph.train_mask], graph.y[graph.train_mask])
        optimizer.zero_grad()
        loss.backward()
        return loss

    history = []  # (validation loss, validation accuracy, test accuracy) per epoch
    with controller if controller is not None else contextlib.nullcontext():
        for _ in range(epochs):
            if controller is None:
                closure()
            else:
                controller.iterate(closure)
            optimizer.step()
            history.append(evaluate(model, graph))
    best_val_acc = max(range(epochs), key=lambda i: (history[i][1], -i))
    return {
        "test_accuracy": 100 * history[selected_epoch([h[0] for h in history])][2],
        "test_at_best_val_accuracy": 100 * history[best_val_acc][2],
        "final_test_accuracy": 100 * history[-1][2],
        "ratio": None if controller is None else controller.stats()["ratio"],
    }


@torch.no_grad()
def evaluate(model: nn.Module, graph: Data) -> tuple[float, float, float]:
    """Validation loss, validation accuracy and test accuracy."""
    model.eval()
    out = model(graph.x, graph.edge_index)
    pred = out.argmax(dim=1)
    val, test = graph.val_mask, graph.test_mask
    return (
        float(F.cross_entropy(out[val], graph.y[val])),
        float((pred[val] == graph.y[val]).float().mean()),
        float((pred[test] == graph.y[test]).float().mean()),
    )


def summarise(runs: dict[str, list[dict]], level: str) -> dict[str, Any]:
    """Mean accuracies, their difference and the target check for one model: no worse than
    fp32 by more than ``TOLERANCE`` points (being better is fine)."""
    fp32 = [r["test_accuracy"] for r in runs["fp32"]]
    gact = [r["test_accuracy"] for r in runs[level]]
    difference = statistics.mean(gact) - statistics.mean(fp32)
    by_val_acc = [
        statistics.mean(r["test_at_best_val_accuracy"] for r in runs[k]) for k in ("fp32", level)
    ]
    return {
        "fp32_mean": statistics.mean(fp32),
        f"{level}_mean": statistics.mean(gact),
        "difference": difference,
        "within_tolerance": difference >= -TOLERANCE,
        "difference_at_best_val_accuracy": by_val_acc[1] - by_val_acc[0],
        "ratio": statistics.mean(r["ratio"] for r in runs[level]),
        "runs": runs,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    graph = load_cora(args.data)
    results: dict[str, Any] = {}
    print(f"{'model':6} {'fp32':>7} {args.level:>7} {'diff':>6}  ratio  diff >= -{TOLERANCE}")
    for name in args.models.split(","):
        runs: dict[str, list[dict]] = {"fp32": [], args.level: []}
        for seed in args.seeds:  # fp32 and GACT interleaved, seed by seed
            for key, level in (("fp32", None), (args.level, args.level)):
                runs[key].append({"seed": seed, **train(graph, name, seed, level, args.epochs)})
        results[name] = row = summarise(runs, args.level)
        print(
            f"{name:6} {row['fp32_mean']:7.2f} {row[f'{args.level}_mean']:7.2f} "
            f"{row['difference']:+6.2f} {row['ratio']:6.2f}x  {row['within_tolerance']}"
        )
    record = {
        "dataset": "cora (Planetoid public split: 140 / 500 / 1000)",
        "metric": "test accuracy (%) at the epoch of lowest validation loss",
        "level": args.level,
        "seeds": args.seeds,
        "epochs": args.epochs,
        "tolerance_points": TOLERANCE,
        "models": results,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
