"""Real data: the MNIST CNN example at L2 ends within 0.5 points of fp32 (``nox -s slow``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "examples" / "vision" / "train_vision.py"
DATA = Path(os.environ.get("GACT_DATA", ROOT.parent / "shared" / "data"))


def _train(tmp_path: Path, *level: str) -> dict:
    out = tmp_path / f"{'-'.join(level) or 'fp32'}.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--data",
        str(DATA),
        "--dataset",
        "mnist",
        "--epochs",
        "1",
        "--seed",
        "0",
        "--no-progress",
        "--json",
        str(out),
        *level,
    ]
    subprocess.run(cmd, check=True, timeout=1800)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "mnist").is_dir(), reason=f"no MNIST under {DATA}")
def test_mnist_cnn_at_l2_matches_fp32(tmp_path: Path) -> None:
    fp32 = _train(tmp_path)
    l2 = _train(tmp_path, "--gact", "--level", "L2")
    assert fp32["final_metric"] > 0.95  # the example really learns
    assert abs(l2["final_metric"] - fp32["final_metric"]) <= 0.005, (fp32, l2)
    assert l2["compression_ratio"] >= 7.0
