"""The Lightning callback's logic, shared by the ``lightning`` and ``pytorch_lightning`` packages
(each subclasses it with its own ``Callback``); it imports neither."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from . import _session
from ._session import CallbackBase, ConfigLike, IntegrationError, TrainingSession

__all__ = ["LightningGact"]

# NOTE [Lightning steps]
# Automatic optimization runs, for every batch, ``on_train_batch_start``, then (inside the
# optimizer closure) ``training_step`` and backward, then, on the batches that end an
# accumulation window, ``on_before_optimizer_step`` and ``optimizer.step()``, and finally
# ``on_train_batch_end``. The hooks are installed from the first to the last of these (NOTE
# [Hooks only while training runs] in _session.py); ``on_exception`` removes them when anything
# in between raises, and ``on_train_epoch_end`` when the module ends the epoch early. A batch after which the optimizer stepped ends the controller's
# step; when an adaptive level is due, its probes call the strategy's ``training_step`` again
# on that batch (same precision context, same loss) and back-propagate the loss it returns,
# with ``self.log`` silenced so that probes do not add to the logged metrics. Other side effects
# of ``training_step`` (a torchmetrics update, a counter) happen once more per probe.


@contextlib.contextmanager
def _logging_silenced(module: nn.Module) -> Iterator[None]:
    """``module.log`` (and so ``log_dict``) does nothing in the body."""
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log


def _takes_batch_idx(training_step: Any) -> bool:
    """Whether Lightning passes ``batch_idx`` to ``training_step`` (two or more arguments)."""
    params = inspect.signature(training_step).parameters.values()
    if any(p.name == "batch_idx" or p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional for p in params) >= 2


class LightningGact(CallbackBase):
    """The hooks of the Lightning ``GactCallback`` (documented in gact.integrations.lightning).

    Args:
        config: a level name (``"L2"``) or a ``gact.GactConfig``.
        probe_batch_size: see ``CallbackBase``.
    """

    _STARTED_BY = "trainer.fit()"

    def __init__(
        self,
        config: ConfigLike = "L2",
        probe_batch_size: int | float = _session.DEFAULT_PROBE_SHARE,
    ) -> None:
        super().__init__(config, probe_batch_size)
        self._batch: tuple[Any, int] | None = None
        self._stepped = False
        self._restored: dict[str, Any] | None = None  # a checkpoint's run state, not loaded yet

    def state_dict(self) -> dict[str, Any]:
        """GACT's run state for Lightning's checkpoints (NOTE [Resumed runs] in resume.py)."""
        return {} if self._session is None else {"gact": self._session.controller.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores a checkpoint (``fit(ckpt_path=...)``): GACT's run goes on as the
        one saved, from the controller that training starts."""
        self._restored = state_dict.get("gact")

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
        if not pl_module.automatic_optimization:
            raise IntegrationError(
                "GactCallback supports automatic optimization only: its probes replay "
                "training_step, which steps the optimizer under manual optimization. With "
                "manual optimization, use a gact.Controller in training_step and call "
                "controller.iterate(closure) after your optimizer step"
            )
        if self._session is None or self._session.model is not pl_module:
            self._session = TrainingSession(pl_module, self.config)
        if self._restored is not None:
            self._session.restore(self._restored)
            self._restored = None

    def on_train_batch_start(
        self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        self._batch = (batch, batch_idx)
        self._stepped = False
        self._started().begin()

    def on_before_optimizer_step(self, trainer: Any, pl_module: nn.Module, optimizer: Any) -> None:
        self._stepped = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        session = self._started()
        try:
            if self._stepped:
                assert self._batch is not None
                fraction = _session.sub_batch_fraction(self._batch[0], self.probe_batch_size)
                session.end_step(lambda: self._probe(trainer, pl_module), fraction)
        finally:
            session.end()
        if self._stepped:
            pl_module.log_dict(session.figures(), on_step=True, on_epoch=False, batch_size=1)

    def _probe(self, trainer: Any, pl_module: nn.Module) -> None:
        """Forward, loss and backward of the step's last batch, as Lightning runs them."""
        assert self._batch is not None
        batch, batch_idx = self._batch
        batch = _session.sub_batch(batch, self.probe_batch_size)  # NOTE [Sub-batch probes]
        args = (batch, batch_idx) if _takes_batch_idx(pl_module.training_step) else (batch,)
        with _logging_silenced(pl_module):
            output = trainer.strategy.training_step(*args)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if not isinstance(loss, torch.Tensor):
            raise IntegrationError(
                "GactCallback's sensitivity probe replayed training_step on the step's last "
                f"batch and got {type(output).__name__} instead of a loss (a tensor, or a dict "
                "with 'loss'); an adaptive level needs training_step to return the loss on the "
                "batches that end an optimizer step"
            )
        loss.backward()

    def on_train_epoch_end(self, trainer: Any, pl_module: nn.Module) -> None:
        self._started().end()

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        if self._session is not None:
            self._session.end()
