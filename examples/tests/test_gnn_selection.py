"""The GNN example's model selection (lowest validation loss), its controls (--init-noise,
--gact-seed) and the selection-noise study built on them."""

from __future__ import annotations

import argparse

import pytest
import torch
from gact_examples.train import Run, base_parser, selected_epoch

GNN = "gnn/train_gnn.py"


def test_selected_epoch_is_the_lowest_validation_loss_earliest_on_ties():
    select = selected_epoch
    assert select([0.9, 0.5, 0.7]) == 1
    assert select([0.9, 0.5, 0.7, 0.5]) == 1
    assert select([0.3]) == 0
    with pytest.raises(ValueError, match="no epochs"):
        select([])


def test_record_reports_the_test_accuracy_of_the_selected_epoch(data_root, script):
    argv = ["--data", str(data_root), "--model", "gcn", "--epochs", "6", "--no-progress"]
    rec = script(GNN).main(argv)
    history = rec["history"]
    losses = [h["val_loss"] for h in history]
    best = losses.index(min(losses))
    assert rec["selected_epoch"] == history[best]["epoch"]
    assert rec["final_metric"] == history[best]["test_acc"]
    first_best_acc = max(range(len(history)), key=lambda i: (history[i]["val_acc"], -i))
    assert rec["test_at_best_val_accuracy"] == history[first_best_acc]["test_acc"]
    assert rec["last_test_accuracy"] == history[-1]["test_acc"]


def test_init_noise_perturbs_each_weight_by_its_relative_size(script):
    module = script(GNN)
    torch.manual_seed(0)
    model = module.GNN("gcn", in_dim=64, hidden=64, num_classes=3)
    before = [p.detach().clone() for p in model.parameters()]
    module.perturb_(model, 0.01, seed=3)
    ratios = torch.cat([(p.detach() / b)[b != 0] - 1 for p, b in zip(model.parameters(), before)])
    assert ratios.numel() > 4000
    assert 0.007 < float(ratios.std()) < 0.013 and abs(float(ratios.mean())) < 0.003
    again = module.GNN("gcn", in_dim=64, hidden=64, num_classes=3)
    again.load_state_dict(dict(zip(dict(model.named_parameters()), before)))
    module.perturb_(again, 0.01, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_init_noise_out_of_range_is_a_usage_error(data_root, script, capsys, value):
    with pytest.raises(SystemExit) as exc:
        script(GNN).main(["--data", str(data_root), "--init-noise", value])
    assert exc.value.code == 2 and "--init-noise" in capsys.readouterr().err


def test_gact_seed_seeds_the_controllers_rounding():
    args = base_parser("x", epochs=1).parse_args(["--gact", "--level", "L1", "--gact-seed", "7"])
    model = torch.nn.Linear(4, 4)
    with Run(args, model, torch.device("cpu")) as run:
        assert run.controller is not None and run.controller.config.seed == 7
    assert isinstance(args, argparse.Namespace) and args.seed == 0


def test_selection_noise_table_averages_draws_against_fp32(script):
    selection = script("selection_noise.py")
    keys = selection.SELECTIONS
    acc = {s: 0.8 for s in keys}

    def rec(delta):
        return {s: v + delta for s, v in acc.items()}

    result = {
        "models": ["gat"],
        "seeds": 2,
        "arms": ["L2"],
        "runs": {
            "gat|0|fp32": [rec(0.0)],
            "gat|1|fp32": [rec(0.01)],
            "gat|0|L2": [rec(-0.01), rec(0.0)],  # gaps -1, 0 points
            "gat|1|L2": [rec(0.0), rec(0.01)],  # gaps -1, 0 points
        },
    }
    rows = [line for line in selection.table(result).splitlines() if line.startswith("| gat")]
    assert len(rows) == len(keys)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2:] == ["L2", "-0.50", "-1.00 .. +0.00", "0.71"]


def test_selection_noise_runs_the_example_and_a_zero_perturbation_shows_no_gap(
    data_root, script, tmp_path
):
    out = tmp_path / "sel.json"
    argv = ["--data", str(data_root), "--models", "gcn", "--levels", "L1", "--seeds", "1"]
    argv += ["--draws", "2", "--epochs", "3", "--init-noise", "0", "--out", str(out)]
    argv += ["--work-dir", str(tmp_path / "work")]
    result = script("selection_noise.py").main(argv)
    assert out.exists() and result["arms"] == ["fp32, init noise 0", "L1"]
    noise_rows = [
        line
        for line in script("selection_noise.py").table(result).splitlines()
        if "noise 0" in line
    ]
    assert len(noise_rows) == 3
    assert all("| +0.00 | +0.00 .. +0.00 | 0.00 |" in row for row in noise_rows)
