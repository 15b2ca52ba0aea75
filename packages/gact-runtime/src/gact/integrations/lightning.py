"""GACT for Lightning (the ``lightning`` package): one callback.

Needs the ``lightning`` extra: ``pip install "gact-runtime[lightning]"``. For the older
``pytorch_lightning`` package, use ``gact.integrations.pytorch_lightning.GactCallback``.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from ._lightning import LightningGact

__all__ = ["GactCallback"]


class GactCallback(LightningGact, Callback):
    """Trains a ``LightningModule`` with GACT's compressed activations.

    Works at every level, adaptive ones included (their sensitivity probes replay
    ``training_step`` on the optimizer step's last batch), with automatic optimization, gradient
    accumulation (one GACT step per optimizer step) and precision plugins
    (``precision="bf16-mixed"``). After each optimizer step, ``controller.stats()``'s numeric
    figures are logged as ``gact/ratio``, ``gact/stored_bytes``, ... Neither the end of training
    nor an exception leaves the hooks installed.

    Args:
        config: a level name (``"L2"``) or a ``gact.GactConfig``.
        probe_batch_size: sensitivity probes replay the first this many rows of the batch (an
            int) or this share of them (a float in ``(0, 1]``; ``1.0``: all; default a quarter,
            at least 2 rows): cheaper adaptations, noisier estimates.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> import lightning.pytorch as pl
        >>> from gact.integrations.lightning import GactCallback
        >>> class Classifier(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
        ...                                        torch.nn.Linear(64, 4))
        ...     def training_step(self, batch, batch_idx):
        ...         x, y = batch
        ...         return F.cross_entropy(self.net(x), y)
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randint(0, 4, (64,)))
        >>> gact_callback = GactCallback("L2")
        >>> trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[gact_callback])
        >>> trainer.fit(Classifier(), torch.utils.data.DataLoader(data, batch_size=32))
        >>> gact_callback.controller.stats()["step"]
        2
    """
