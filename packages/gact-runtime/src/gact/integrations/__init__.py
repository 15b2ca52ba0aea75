"""GACT inside training frameworks: one callback each, a one-line addition to a training script.

- ``gact.integrations.transformers.GactCallback``: Hugging Face ``transformers.Trainer``
  (extra ``transformers``).
- ``gact.integrations.lightning.GactCallback``: ``lightning.pytorch.Trainer`` (extra
  ``lightning``); ``gact.integrations.pytorch_lightning.GactCallback`` for the older
  ``pytorch_lightning`` package.

Each submodule imports its framework when it is imported; ``import gact`` and
``import gact.integrations`` import none of them. PyTorch Geometric models need no integration:
wrap them in a ``gact.Controller`` like any other model (integer index tensors are packed
losslessly).
"""

from __future__ import annotations

from ._session import IntegrationError

__all__ = ["IntegrationError"]
