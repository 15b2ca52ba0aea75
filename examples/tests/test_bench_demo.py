"""bench.py's report writing (synthetic records) and a short demo run."""

from __future__ import annotations

import argparse
import json

import bench


def _rec(level, metric, orig, stored, seed):
    return {
        "level": level,
        "final_metric": metric,
        "original_bytes": orig,
        "stored_bytes": stored,
        "compression_ratio": orig / stored,
        "step_time_s": 0.01,
        "throughput": 100.0,
        "throughput_unit": "images/s",
        "peak_memory_delta_bytes": stored * 3 + 10,
        "memory_method": "test",
        "seed": seed,
    }


def test_render_and_markdown_markers(tmp_path):
    levels = ["L0", "L1", "L2", "L2.2"]
    args = argparse.Namespace(
        examples=["gcn", "text"],
        levels=levels,
        seeds=2,
        quick=True,
        no_mem=False,
        data="DATA",
        device=None,
    )
    ratio = {"L0": 1, "L1": 8, "L2": 8, "L2.2": 16}
    results = {"train": {}, "mem": {}, "max_batch": {}, "failures": ["x failed"], "wall_s": 60}
    for name, metric in (("gcn", 0.8), ("text", 2.0)):
        results["train"][name] = {
            lv: [_rec(lv, metric - 0.01 * s, 1000, 1000 // ratio[lv], s) for s in range(2)]
            for lv in levels
        }
    results["mem"]["text"] = {lv: [_rec(lv, None, 10**8, 10**8 // ratio[lv], 0)] for lv in levels}
    section = bench.render(args, results, {"cpu": "test", "cores": 2})
    assert section.startswith(bench.BEGIN) and section.endswith(bench.END)
    assert "GCN / Cora" in section and "char-GPT" in section and "x failed" in section
    assert "79.50 ± 0.71" in section  # mean ± std over the two seeds, in percent
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nkernels section\n")
    bench.write_markdown(md, section)
    bench.write_markdown(md, section.replace("GCN / Cora", "GCN again"))  # replaced in place
    text = md.read_text()
    assert text.count(bench.BEGIN) == 1 and "kernels section" in text and "GCN again" in text
    args.plots = str(tmp_path / "plots")
    bench.plot(args, results)
    assert (tmp_path / "plots" / "examples_metric.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "examples_memory.png").stat().st_size > 1000


def test_demo_runs(tmp_path, capsys):
    import demo

    records = demo.main(
        [
            "--levels",
            "L0,L2",
            "--epochs",
            "1",
            "--mem-batch",
            "64",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    assert [r["level"] for r in records] == ["L0", "L2"]
    assert all("final_metric" in r for r in records), records
    assert records[1]["compression_ratio"] > 4
    assert (tmp_path / "demo.png").exists()
    assert json.loads((tmp_path / "demo-L2.json").read_text())["level"] == "L2"
    assert "L2" in capsys.readouterr().out
