"""``import gact`` (and ``import gact.integrations``) never imports a training framework."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "torch_geometric")


def test_import_gact_imports_no_framework() -> None:
    code = (
        "import sys, gact, gact.integrations\n"
        f"print(','.join(name for name in {FRAMEWORKS!r} if name in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == ""
