"""Each script's main() for one short epoch on tiny data, at L0 (fp32 measuring) and L2."""

from __future__ import annotations

import json
import math

import pytest
from common.train import REQUIRED_KEYS

TINY = {
    "gcn": ("gnn.train_gnn", ["--model", "gcn", "--epochs", "2"]),
    "sage": ("gnn.train_gnn", ["--model", "sage", "--epochs", "2"]),
    "gat": ("gnn.train_gnn", ["--model", "gat", "--epochs", "2"]),
    "mnist": ("vision.train_vision", ["--dataset", "mnist", "--batch-size", "32", "--width", "4"]),
    "cifar10": (
        "vision.train_vision",
        ["--dataset", "cifar10", "--batch-size", "15", "--width", "4"],
    ),
    "text": (
        "text.train_char_gpt",
        [
            "--steps-per-epoch",
            "3",
            "--batch-size",
            "4",
            "--block-size",
            "16",
            "--n-embd",
            "32",
            "--eval-batches",
            "2",
        ],
    ),
}


def run_main(module: str, argv: list[str]):
    import importlib

    return importlib.import_module(module).main(argv)


def check_record(rec: dict, level: str) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    assert not missing, missing
    assert rec["level"] == level
    assert isinstance(rec["final_metric"], float) and math.isfinite(rec["final_metric"])
    assert rec["original_bytes"] > 0 and rec["stored_bytes"] > 0
    assert rec["peak_memory_bytes"] > 0
    assert rec["step_time_s"] > 0 and rec["throughput"] > 0
    if level == "L0":
        assert rec["compression_ratio"] == pytest.approx(1.0, abs=0.05)
    else:
        assert rec["compression_ratio"] > 1.0
        assert rec["stored_bytes"] < rec["original_bytes"]


@pytest.mark.parametrize("level", ["L0", "L2"])
@pytest.mark.parametrize("name", sorted(TINY))
def test_script_main(name, level, data_root, tmp_path):
    module, extra = TINY[name]
    out = tmp_path / "r.json"
    argv = ["--data", str(data_root), "--seed", "1", "--device", "cpu", "--no-progress"]
    argv += ["--gact", "--level", level, "--json", str(out), *extra]
    rec = run_main(module, argv)
    on_disk = json.loads(out.read_text())
    assert on_disk["model"] == rec["model"] and on_disk["seed"] == 1
    check_record(on_disk, level)
    if name in ("gcn", "sage", "gat", "mnist", "cifar10"):
        assert 0.0 <= on_disk["final_metric"] <= 1.0
    else:
        assert on_disk["metric"] == "val_loss" and on_disk["final_metric"] > 0


def test_fp32_without_gact(data_root, tmp_path):
    rec = run_main("gnn.train_gnn", ["--data", str(data_root), "--epochs", "2", "--no-progress"])
    assert rec["level"] == "fp32" and rec["original_bytes"] is None
    assert 0.0 <= rec["final_metric"] <= 1.0


def test_get_mem_run(data_root, capsys):
    rec = run_main(
        "vision.train_vision",
        [
            "--data",
            str(data_root),
            "--dataset",
            "mnist",
            "--batch-size",
            "16",
            "--width",
            "4",
            "--gact",
            "--level",
            "L2",
            "--get-mem",
            "--mem-steps",
            "2",
            "--no-progress",
        ],
    )
    assert rec["get_mem"] and rec["final_metric"] is None and rec["steps"] == 2
    assert rec["compression_ratio"] > 1.0
    assert "compression ratio" in capsys.readouterr().out


def test_l3_on_cpu_runs_as_l2(data_root, tmp_path):
    """L3 swaps to pinned memory on CUDA only; on the CPU the runtime runs it as L2."""
    argv = ["--data", str(data_root), "--seed", "1", "--device", "cpu", "--no-progress"]
    argv += ["--model", "gcn", "--epochs", "2", "--gact"]
    recs = {lvl: run_main("gnn.train_gnn", [*argv, "--level", lvl]) for lvl in ("L2", "L3")}
    check_record(recs["L3"], "L3")
    assert recs["L3"]["stored_bytes"] == recs["L2"]["stored_bytes"]
    assert recs["L3"]["final_metric"] == recs["L2"]["final_metric"]
