"""examples/memory_breakdown.py on tiny MNIST: one process per level, every sample labelled with
its phase, the adaptive level adapting without probes, the table and the timeline written."""

from __future__ import annotations

import json


def test_levels_in_their_own_processes(data_root, tmp_path, script):
    out_json, out_png = tmp_path / "m.json", tmp_path / "m.png"
    argv = ["--data", str(data_root), "--tasks", "mnist", "--levels", "L0,L2", "--steps", "2"]
    argv += ["--threads", "1", "--json", str(out_json), "--out", str(out_png)]
    script("memory_breakdown.py").main(argv)
    fp32, l2 = json.loads(out_json.read_text())
    assert (fp32["level"], l2["level"]) == ("L0", "L2")
    assert fp32["stored_bytes"] == fp32["saved_bytes"] > 0  # L0 stores what autograd saves
    assert l2["saved_bytes"] == fp32["saved_bytes"]  # same model, same batch, same saves
    assert 0 < l2["stored_bytes"] < l2["saved_bytes"] / 6
    phases = {p for _, p, _ in l2["samples"]}
    # (a small model's optimizer step can fall between two samples: not required)
    assert {"no-grad forward", "forward", "backward"} <= phases
    # the CNN's saves are all measured in the backward, its BatchNorm inputs too: L2 adapts
    # without probes, so no sample falls in an adaptation (NOTE [Measured BatchNorm inputs])
    assert l2["adaptations"] >= 1 and fp32["adaptations"] == 0
    for record in (fp32, l2):
        assert "adaptation" not in {p for _, p, _ in record["samples"]}
        assert record["peak_by_phase"]["adaptation"] is None  # no sample: no peak, not 0
    training = [v for p, v in l2["peak_by_phase"].items() if p != "no-grad forward" and v]
    assert l2["peak_bytes"] == max(training) > 0
    assert fp32["peak_bytes"] >= fp32["peak_by_phase"]["backward"] > l2["peak_by_phase"]["backward"]
    assert out_png.stat().st_size > 10_000
