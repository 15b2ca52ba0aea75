"""pytest configuration for this folder's doctests (``pytest --doctest-modules --pyargs gact``):
a module whose framework is not installed is not collected, so the runtime's own doctests run
without the integration extras."""

from __future__ import annotations

import importlib.util

_FRAMEWORKS = {
    "transformers.py": "transformers",
    "lightning.py": "lightning",
    "pytorch_lightning.py": "pytorch_lightning",
}

collect_ignore = [
    module
    for module, framework in _FRAMEWORKS.items()
    if importlib.util.find_spec(framework) is None
]
