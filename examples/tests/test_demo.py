"""The demo end to end on two levels (subprocesses), and its argument checks."""

from __future__ import annotations

import json

import pytest


def test_demo_runs(tmp_path, capsys, script):
    argv = ["--levels", "L0,L2", "--epochs", "1", "--mem-batch", "64", "--out", str(tmp_path)]
    records = script("demo.py").main([*argv, "--quiet"])
    assert [r["level"] for r in records] == ["L0", "L2"]
    assert all("final_metric" in r and r["mem_run"] for r in records), records
    assert records[1]["compression_ratio"] > 4
    # the memory runs measure the live-tensor peak beside the process's resident peak
    live = [r["mem_run"]["live_peak_bytes"] for r in records]
    assert all(v > 0 for v in live) and live[1] < live[0]
    assert (tmp_path / "demo.png").stat().st_size > 1000
    assert json.loads((tmp_path / "demo-L2.json").read_text())["level"] == "L2"
    out = capsys.readouterr().out
    assert "[1/2] fp32 (32 bit): training" in out and "[2/2] L2 (adaptive, 4 bit avg)" in out
    table = out.split("-----\n", 1)[1]
    assert table.startswith("fp32 ") and "\nL2 " in table  # one label per level everywhere
    assert "live peak" in out and "peak RSS" in out


def test_demo_rejects_unknown_levels(script, capsys):
    with pytest.raises(SystemExit) as exc:
        script("demo.py").main(["--levels", "L0,L9"])
    assert exc.value.code == 2 and "L9" in capsys.readouterr().err
