"""GACT inside training frameworks: one callback each, a one-line addition to a training script.

- ``gact.integrations.transformers.GactCallback``: Hugging Face ``transformers.Trainer``
  (extra ``transformers``).
- ``gact.integrations.lightning.GactCallback``: ``lightning.pytorch.Trainer`` (extra
  ``lightning``); ``gact.integrations.pytorch_lightning.GactCallback`` for the older
  ``pytorch_lightning`` package.

Every callback's sensitivity probes replay a quarter of the step's last batch by default
(``probe_batch_size``; ``probe_rows`` says how many rows, ``DEFAULT_PROBE_SHARE`` the share).
Each submodule imports its framework when it is imported; ``import gact`` and
``import gact.integrations`` import none of them. PyTorch Geometric models need no integration:
wrap them in a ``gact.Controller`` like any other model (integer index tensors are packed
losslessly).
"""

from __future__ import annotations

from ._session import DEFAULT_PROBE_SHARE, IntegrationError, probe_rows

__all__ = ["DEFAULT_PROBE_SHARE", "IntegrationError", "probe_rows"]
