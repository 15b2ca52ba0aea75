"""Puts this directory on sys.path so that tests can ``import kernels_testing`` (the shared
helpers) whichever directory pytest was started from; the helper module's name is unique, so
this suite and the runtime's can run in one pytest call."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
