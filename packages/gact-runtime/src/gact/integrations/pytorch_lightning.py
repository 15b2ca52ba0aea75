"""GACT for the ``pytorch_lightning`` package (Lightning before its rename): one callback.

Needs ``pytorch_lightning`` (``pip install pytorch-lightning``); with the ``lightning`` package,
use ``gact.integrations.lightning.GactCallback``.
"""

from __future__ import annotations

from pytorch_lightning import Callback

from ._lightning import LightningGact

__all__ = ["GactCallback"]


class GactCallback(LightningGact, Callback):
    """``gact.integrations.lightning.GactCallback`` for ``pytorch_lightning.Trainer``: the same
    hooks and behaviour (see there).

    Args:
        config: a level name (``"L2"``) or a ``gact.GactConfig``.
        probe_batch_size: sensitivity probes replay the first this many rows of the batch (an
            int) or this share of them (a float in ``(0, 1]``; ``1.0``: all; default a quarter,
            at least 2 rows): cheaper adaptations, noisier estimates.

    Example::

        >>> import pytorch_lightning as pl
        >>> from gact.integrations.pytorch_lightning import GactCallback
        >>> trainer = pl.Trainer(max_steps=100, accelerator="cpu", logger=False,
        ...                      callbacks=[GactCallback("L2")])
    """
