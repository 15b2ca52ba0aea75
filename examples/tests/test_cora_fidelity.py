"""examples/pyg/cora_fidelity.py on a tiny Planetoid graph: PyG's models trained at fp32 and at a
GACT level seed by seed, and the summary computed from those runs."""

from __future__ import annotations

import json
import statistics

import pytest

pytest.importorskip("torch_geometric")  # gact-runtime[pyg], installed by tests(examples)

SCRIPT = "pyg/cora_fidelity.py"


def test_fp32_against_a_level_per_model(data_root, tmp_path, script):
    out = tmp_path / "cora.json"
    argv = ["--data", str(data_root), "--models", "gcn,gat", "--seeds", "0,1", "--epochs", "3"]
    record = script(SCRIPT).main([*argv, "--level", "L2.2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert record["level"] == "L2.2" and record["seeds"] == [0, 1]
    assert sorted(record["models"]) == ["gat", "gcn"]
    for row in record["models"].values():
        runs = row["runs"]
        assert [r["seed"] for r in runs["fp32"]] == [r["seed"] for r in runs["L2.2"]] == [0, 1]
        assert all(r["ratio"] is None for r in runs["fp32"])
        assert all(r["ratio"] > 8 for r in runs["L2.2"])  # about 2 bits of 32
        for r in runs["fp32"] + runs["L2.2"]:
            assert 0 <= r["test_accuracy"] <= 100
        fp32 = statistics.mean(r["test_accuracy"] for r in runs["fp32"])
        compressed = statistics.mean(r["test_accuracy"] for r in runs["L2.2"])
        assert row["difference"] == pytest.approx(compressed - fp32)
        assert row["within_tolerance"] == (row["difference"] >= -record["tolerance_points"])


def test_a_folder_without_cora_is_named(tmp_path, script):
    with pytest.raises(FileNotFoundError, match=r"ind\.cora"):
        script(SCRIPT).main(["--data", str(tmp_path), "--out", str(tmp_path / "c.json")])


@pytest.mark.parametrize("argv", [["--models", "gcn,mlp"], ["--seeds", "0,one"], ["--level", "L0"]])
def test_bad_arguments_are_usage_errors(argv, tmp_path, script, capsys):
    with pytest.raises(SystemExit) as exc:
        script(SCRIPT).main(["--data", str(tmp_path), *argv])
    assert exc.value.code == 2
    assert argv[-1].split(",")[-1] in capsys.readouterr().err
