"""The package is numpy-only: importing it must not import torch."""

import subprocess
import sys


def test_import_does_not_load_torch() -> None:
    code = (
        "import sys, gact_policy\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert all(hasattr(gact_policy, n) for n in gact_policy.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
