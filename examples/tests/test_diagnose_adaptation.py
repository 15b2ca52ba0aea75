"""diagnose_adaptation.py on tiny data: true per-tensor errors, estimates, the report."""

from __future__ import annotations

import json

import numpy as np
import pytest


@pytest.mark.parametrize("model", ["char-gpt", "bert"])
def test_diagnosis_measures_truth_and_estimates(model, data_root, tmp_path, script, capsys):
    if model == "bert":
        pytest.importorskip("transformers")  # examples[transformers], in tests(examples)
        data_root = tmp_path / "words"  # the passage task needs 64 chunks of 512 words
        (data_root / "tinyshakespeare").mkdir(parents=True)
        words = np.random.default_rng(0).integers(0, 200, 64 * 512 + 7)
        (data_root / "tinyshakespeare" / "input.txt").write_text(" ".join(f"w{w}" for w in words))
    diagnose = script("diagnose_adaptation.py")
    out = tmp_path / "d.json"
    argv = ["--data", str(data_root), "--model", model, "--steps", "0,1", "--seeds", "2"]
    diagnose.main([*argv, "--out", str(out), "--threads", "1", "--layers", "1"])
    recs = json.loads(out.read_text())["records"]
    assert [r["step"] for r in recs] == [0, 1]
    for rec in recs:
        n = len(rec["keys"])
        assert n > 0 and len(rec["numel"]) == len(rec["pinned"]) == len(rec["lower"]) == n
        truth = rec["truth"]
        mse = {w: np.array(truth[w]["mse"]) for w in ("2", "4", "8")}
        assert all(len(v) == n and (v >= 0).all() for v in mse.values())
        # rounding at 2 bits perturbs the gradient far more than at 8 bits
        assert mse["2"].sum() > 100 * mse["8"].sum() > 0
        est = rec["estimates"]
        assert len(est["pairwise"]) == len(est["reference"]) == len(est["runtime"]) == n
        # the linear layers' inputs are measured, the rest probed: fewer probes than pairwise's
        assert 0 < sum(est["measured"]) < n
        assert 0 < est["runtime_probes"] < est["pairwise_probes"] + 2
    if model == "bert":  # dropout masks are two-valued: pinned, and quantizing them costs 0
        pinned = np.array(recs[0]["pinned"]) == 1
        assert pinned.any() and (np.array(recs[0]["truth"]["2"]["mse"])[pinned] == 0).all()
    capsys.readouterr()
    diagnose.main(["--report", str(out)])
    table = capsys.readouterr().out
    assert "rank corr." in table and "probed at step 1 (pairwise, as the runtime)" in table
    assert "measured and probed at step 1 (the runtime now)" in table


def _diagnosed_at_step_0(script, data_root, tmp_path, model: str) -> dict:
    """The record of ``diagnose_adaptation.py --model MODEL --steps 0 --seeds 2``."""
    out = tmp_path / "d.json"
    argv = ["--data", str(data_root), "--model", model, "--steps", "0", "--seeds", "2"]
    script("diagnose_adaptation.py").main([*argv, "--out", str(out), "--threads", "2"])
    (rec,) = json.loads(out.read_text())["records"]
    return rec


def test_diagnosis_of_the_resnet_measures_its_batchnorm_inputs(data_root, tmp_path, script):
    """The ResNet-18 layout (tiny CIFAR-10): every BatchNorm input is measured, not probed
    (NOTE [Measured BatchNorm inputs]), and so is everything else: no probe runs."""
    rec = _diagnosed_at_step_0(script, data_root, tmp_path, "resnet18")
    est = rec["estimates"]
    norms = [i for i, c in enumerate(rec["consumers"]) if c == ["NativeBatchNormBackward"]]
    assert len(norms) == 20 and all(est["measured"][i] for i in norms)
    assert sum(est["measured"]) == len(rec["keys"]) and est["runtime_probes"] == 0


def test_diagnosis_of_the_llama_measures_its_silu_inputs(data_root, tmp_path, script):
    """The LLaMA-style decoder: its SiLU inputs (the gate projections' outputs) are measured
    (NOTE [Measured pointwise inputs]); the product ``silu(gate) * up``, the RMSNorm inputs and
    the attention are probed."""
    pytest.importorskip("transformers")  # examples[transformers], in tests(examples)
    rec = _diagnosed_at_step_0(script, data_root, tmp_path, "llama")
    est = rec["estimates"]
    silu = [i for i, c in enumerate(rec["consumers"]) if c == ["SiluBackward"]]
    assert len(silu) == 2 and all(est["measured"][i] for i in silu)
    products = [i for i, k in enumerate(rec["keys"]) if k.startswith("model.layers.0.mlp#")]
    assert products and not any(est["measured"][i] for i in products)
    assert est["runtime_probes"] > 0
