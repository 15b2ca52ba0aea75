"""GACT for Hugging Face ``transformers.Trainer``: one callback.

Needs the ``transformers`` extra: ``pip install "gact-runtime[transformers]"``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from . import _session
from ._session import CallbackBase, ConfigLike, IntegrationError, TrainingSession

__all__ = ["GactCallback"]

# NOTE [Trainer steps]
# The Trainer calls ``training_step(model, inputs, ...)`` once per micro-batch (forward, the
# Trainer's loss, backward) and ``on_step_end`` once per optimizer step, after
# ``optimizer.step()`` and ``zero_grad()``. The callback replaces ``training_step`` on the trainer
# *instance* by a ``_StepRecorder`` for the length of ``train()``: the recorder installs the
# hooks around the original call (NOTE [Hooks only while training runs] in _session.py) and
# remembers its arguments. ``on_step_end`` ends the controller's step; when an adaptive level is
# due, its probes call the original ``training_step`` again on the remembered micro-batch, so
# they use exactly the Trainer's inputs, autocast, loss (``compute_loss``: label smoothing,
# ``compute_loss_func`` and subclass overrides included) and backward. Probes set the gradients
# aside and restore them, so the replayed backward leaves no trace. Callbacks are given no
# trainer, so ``on_train_begin`` finds the one running it on the call stack: the frame whose
# ``self`` is a ``Trainer`` that lists this callback.


class _StepRecorder:
    """Stands in for ``trainer.training_step`` (see NOTE [Trainer steps])."""

    def __init__(
        self, original: Callable[..., Any], session: TrainingSession, replaced: Any
    ) -> None:
        self.original = original
        self.session = session
        self.replaced = replaced  # the instance attribute it replaced, if there was one
        self.last: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.last = (args, kwargs)
        with self.session.active():
            return self.original(*args, **kwargs)

    def inputs(self) -> Any:
        """The last micro-batch's inputs (``None`` before the first)."""
        if self.last is None:
            return None
        args, kwargs = self.last
        return kwargs["inputs"] if "inputs" in kwargs else args[1] if len(args) > 1 else None

    def probe(self, probe_batch_size: int | float) -> None:
        """Forward, loss and backward of the last micro-batch's rows that ``probe_batch_size``
        names, as the Trainer runs them (NOTE [Sub-batch probes] in _session.py)."""
        if self.last is None:
            raise IntegrationError(
                "GactCallback: an optimizer step ended before any training_step ran, so there is "
                "no batch to probe; this Trainer does not call training_step, which the callback "
                "needs (use a Controller directly in a custom loop)"
            )
        args, kwargs = self.last
        if "inputs" in kwargs:
            kwargs = {**kwargs, "inputs": _session.sub_batch(kwargs["inputs"], probe_batch_size)}
        elif len(args) > 1:  # training_step(model, inputs, ...)
            args = (args[0], _session.sub_batch(args[1], probe_batch_size), *args[2:])
        self.original(*args, **kwargs)


def _restore(trainer: Trainer) -> None:
    """Give ``trainer`` its own ``training_step`` back if a ``_StepRecorder`` stands in."""
    recorder = vars(trainer).get("training_step")
    if isinstance(recorder, _StepRecorder):
        if recorder.replaced is None:
            del trainer.training_step
        else:
            trainer.training_step = recorder.replaced


def _running_trainer(callback: TrainerCallback) -> Trainer:
    """The ``Trainer`` whose callback handler is calling ``callback`` right now."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in owner.callback_handler.callbacks:
            return owner
        frame = frame.f_back
    raise IntegrationError(
        "GactCallback could not find the transformers.Trainer running it; pass it to a Trainer "
        "(Trainer(..., callbacks=[GactCallback('L2')]) or trainer.add_callback(...)) and call "
        "trainer.train()"
    )


class GactCallback(CallbackBase, TrainerCallback, ExportableState):
    """Trains a ``transformers.Trainer``'s model with GACT's compressed activations.

    Works at every level, adaptive ones included (their sensitivity probes replay the Trainer's
    own ``training_step`` on the step's last micro-batch), with gradient accumulation (one GACT
    step per optimizer step) and with the Trainer's autocast (``bf16=True``/``fp16=True``). At
    every logging step, the numeric figures of ``controller.stats()`` go through the Trainer's
    logging as ``gact/ratio``, ``gact/stored_bytes``, ... to every logger it reports to. The
    hooks are installed only while the Trainer runs a micro-batch's forward and backward, so
    neither the end of training nor an exception anywhere in it leaves them installed.

    Args:
        config: a level name (``"L2"``) or a ``gact.GactConfig``.
        probe_batch_size: sensitivity probes replay the first this many rows of the
            micro-batch (an int) or this share of them (a float in ``(0, 1]``; ``1.0``: all;
            default a quarter, at least 2 rows): cheaper adaptations, noisier estimates. A loss
            normalised by the Trainer's ``num_items_in_batch`` is then scaled down, the same for
            every probe.

    Example::

        >>> import tempfile, torch
        >>> from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        >>> from gact.integrations.transformers import GactCallback
        >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
        >>> ids = torch.randint(0, 64, (8, 16))
        >>> data = [{"input_ids": row, "labels": row} for row in ids]
        >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, report_to="none",
        ...                          per_device_train_batch_size=4, save_strategy="no")
        >>> gact_callback = GactCallback("L2")
        >>> trainer = Trainer(model=model, args=args, train_dataset=data,
        ...                   callbacks=[gact_callback])
        >>> _ = trainer.train()  # doctest: +ELLIPSIS
        {'train_runtime': ...}
        >>> gact_callback.controller.stats()["step"]
        2
    """

    _STARTED_BY = "trainer.train()"

    def __init__(
        self,
        config: ConfigLike = "L2",
        probe_batch_size: int | float = _session.DEFAULT_PROBE_SHARE,
    ) -> None:
        super().__init__(config, probe_batch_size)
        self._model: Any = None
        self._trainer: Trainer | None = None
        self._recorder: _StepRecorder | None = None
        self._restored: dict[str, Any] | None = None  # a checkpoint's run state, not loaded yet

    def state(self) -> dict[str, Any]:
        """What the Trainer keeps of the callback in its checkpoints (``ExportableState``):
        the configuration and GACT's run state (NOTE [Resumed runs] in resume.py), restored
        with ``TrainingArguments(restore_callback_states_from_checkpoint=True)``."""
        run = None if self._session is None else self._session.controller.state_dict()
        return {
            "args": {
                "config": dataclasses.asdict(self.config),
                "probe_batch_size": self.probe_batch_size,
            },
            "attributes": {"_restored": run},
        }

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        trainer = _running_trainer(self)
        model = trainer.model if model is None else model
        if self._session is None or self._model is not model:
            self._session = TrainingSession(model, self.config)
            self._model = model
        if self._restored is not None:
            self._session.restore(self._restored)
            self._restored = None
        _restore(trainer)  # a previous train() that failed left its recorder in place
        self._recorder = _StepRecorder(
            trainer.training_step, self._session, vars(trainer).get("training_step")
        )
        trainer.training_step = self._recorder  # type: ignore[method-assign]
        self._trainer = trainer

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        session = self._started()
        if self._recorder is None or self._trainer is None:
            raise IntegrationError("GactCallback.on_step_end ran before on_train_begin")
        recorder = self._recorder
        fraction = _session.sub_batch_fraction(recorder.inputs(), self.probe_batch_size)
        session.end_step(lambda: recorder.probe(self.probe_batch_size), fraction)
        if control.should_log:
            self._trainer.log(session.figures())
            control.should_log = True  # Trainer.log cleared it; the Trainer's own log follows

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._trainer is not None:
            _restore(self._trainer)
        self._trainer = self._recorder = None
