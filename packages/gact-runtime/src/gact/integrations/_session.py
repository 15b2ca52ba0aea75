"""What every framework callback shares: a ``Controller`` driven by a framework's loop."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Union

import torch
from torch import nn

from ..config import LEVELS, GactConfig
from ..controller import Controller
from ..errors import ConfigError, GactError

__all__ = [
    "DEFAULT_PROBE_SHARE",
    "CallbackBase",
    "ConfigLike",
    "IntegrationError",
    "TrainingSession",
    "probe_rows",
    "resolve_config",
    "sub_batch",
    "sub_batch_fraction",
]

ConfigLike = Union[str, GactConfig, dict[str, Any]]
#: The share of a batch that sensitivity probes replay by default (NOTE [Sub-batch probes]).
DEFAULT_PROBE_SHARE = 0.25


class IntegrationError(GactError):
    """A training framework drives GACT's callback in a way the callback cannot follow."""


def resolve_config(config: ConfigLike) -> GactConfig:
    """The ``GactConfig`` a callback was given: a level name, a configuration, or its fields
    as a dict (as a framework restores a callback from a checkpoint).

    Raises:
        TypeError: if ``config`` is none of them.
        ConfigError: if the level name is unknown, or a field is.
    """
    if isinstance(config, GactConfig):
        return config
    if isinstance(config, str):
        return GactConfig.from_level(config)
    if isinstance(config, dict):
        unknown = set(config) - {f.name for f in dataclasses.fields(GactConfig)}
        if unknown:
            raise ConfigError(f"unknown GactConfig fields {sorted(unknown)}")
        return GactConfig(**config)
    raise TypeError(
        f"config must be a level name ({', '.join(LEVELS)}) or a gact.GactConfig, got "
        f"{type(config).__name__}; e.g. GactCallback('L2') or "
        "GactCallback(GactConfig.from_level('L2', adapt_interval=500))"
    )


# NOTE [Hooks only while training runs]
# A framework's loop raises wherever it likes (a collator, an evaluation metric, a checkpoint
# write, Ctrl+C) and runs no callback on the way out, so a callback that installed saved-tensor
# hooks at the start of training and removed them at its end would leave them installed after
# any failure (and a second ``train()`` would then find the model already controlled). The
# session therefore installs the controller's hooks only around the framework's own forward and
# backward of a batch (``active()``, a ``with`` block that always uninstalls) and around the end
# of each optimizer step (``end_step``, where probes run). Tensors saved inside stay compressed
# after the hooks come off: autograd keeps each saved tensor's unpack hook with it. Between
# batches, evaluation and checkpointing run with no GACT hook at all.
#
# NOTE [Explicit steps]
# The framework ends every step itself (``end_step`` after each optimizer step), so the
# controller is created with ``explicit_steps=True``: without it, until the first ``step()``, a
# root forward following a backward would end the open step automatically (NOTE [Steps] in
# controller.py), which with gradient accumulation would split the first optimizer step in two.


class TrainingSession:
    """A ``Controller`` whose hooks are installed only while a framework trains a batch.

    Args:
        model: the model the framework trains (its parameters are never compressed).
        config: the GACT configuration.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> from gact import GactConfig
        >>> model = torch.nn.Linear(64, 4)
        >>> x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
        >>> session = TrainingSession(model, GactConfig.from_level("L1", min_numel=0))
        >>> with session.active():
        ...     F.cross_entropy(model(x), y).backward()
        >>> session.end_step(lambda: F.cross_entropy(model(x), y).backward())
        >>> session.controller.stats()["step"]
        1
    """

    def __init__(self, model: nn.Module, config: GactConfig) -> None:
        self.controller = Controller(model, config, explicit_steps=True)

    @property
    def model(self) -> nn.Module:
        return self.controller.model

    def restore(self, state: dict[str, Any]) -> None:
        """Go on with the run a checkpoint saved (``Controller.state_dict``), before training.
        Saved under another configuration than the callback's (a resumed run given another
        level), the run goes on under the saved one, and then the callback's takes over, as
        ``configure`` makes it: the next step's end allocates its budget (NOTE [Resumed runs]
        in resume.py)."""
        config = self.controller.config
        saved = state.get("config") if isinstance(state, dict) else None
        if isinstance(saved, dict) and saved != dataclasses.asdict(config):
            self.controller.configure(resolve_config(saved))
        self.controller.load_state_dict(state)
        if self.controller.config != config:
            self.controller.configure(config)

    def begin(self) -> None:
        """Install the hooks unless they are installed (see NOTE [Hooks only while training
        runs]); ``end()`` must follow on every path."""
        if not self.controller.installed:
            self.controller.install_hook()

    def end(self) -> None:
        """Uninstall the hooks if they are installed; safe to call at any time."""
        if self.controller.installed:
            self.controller.uninstall_hook()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The hooks are installed in the body (if they were not already) and removed after."""
        if self.controller.installed:
            yield
            return
        self.begin()
        try:
            yield
        finally:
            self.end()

    def end_step(self, probe: Callable[[], Any], probe_fraction: float = 1.0) -> None:
        """Close the step the framework's forwards and backwards opened (call it after the
        optimizer step); when an adaptive level is due to adapt, ``probe`` runs the sensitivity
        probes: forward, the framework's loss and backward on the step's last batch (or on
        ``probe_fraction`` of it, NOTE [Sub-batch probes])."""
        with self.active():
            self.controller.iterate(probe, probe_fraction=probe_fraction)

    def figures(self) -> dict[str, float]:
        """The numeric figures of ``controller.stats()``, named ``gact/<name>`` for loggers."""
        return {
            f"gact/{name}": float(value)
            for name, value in self.controller.stats().items()
            if isinstance(value, numbers.Real) and not isinstance(value, bool)
        }


# NOTE [Sub-batch probes]
# A probe replays the step's last batch: forward and backward, a training step's cost, several
# times per adaptation, which kept most runs from affording one (gact_policy's schedule charges
# adaptations against training time). So probes replay the batch's first rows only: a quarter
# of them by default (``DEFAULT_PROBE_SHARE``), at least 2 (BatchNorm in training needs two
# samples per channel), or as many rows or such a share as ``probe_batch_size`` says (``1.0``:
# the whole batch). Every tensor of the batch (nested in lists, tuples and mappings) whose first
# dimension is the batch's (the first tensor's) is cut, and the controller is told the probes'
# share of the batch (``iterate(probe_fraction=...)``), from which it predicts the first
# adaptation's cost (later ones are charged what they measured). The tensors read linearly need
# no probe at all (NOTE [Measured sensitivities]); the estimators compare probes with each
# other, so the sensitivities keep their ranking, their noise grows as the sub-batch shrinks,
# and a model whose statistics depend on the batch (BatchNorm) is probed on a smaller one.


def probe_rows(rows: int, probe_batch_size: int | float = DEFAULT_PROBE_SHARE) -> int:
    """How many of a batch's ``rows`` the sensitivity probes replay (NOTE [Sub-batch probes]).

    Args:
        rows: the batch's rows (``>= 1``).
        probe_batch_size: a number of rows (an int), or a share of the batch (a float in
            ``(0, 1]``, rounded down, at least 2 rows).

    Returns:
        Between 1 and ``rows``.

    Example::

        >>> probe_rows(128), probe_rows(6), probe_rows(1), probe_rows(128, 1.0), probe_rows(8, 20)
        (32, 2, 1, 128, 8)
    """
    if isinstance(probe_batch_size, float):
        probe_batch_size = max(2, math.floor(probe_batch_size * rows))
    return max(1, min(rows, probe_batch_size))


def _check_probe_batch_size(probe_batch_size: object) -> int | float:
    """``probe_batch_size`` if it is a positive int or a float in ``(0, 1]``.

    Raises:
        ValueError: otherwise, with what to pass instead.
    """
    if isinstance(probe_batch_size, float):
        ok = 0.0 < probe_batch_size <= 1.0
    else:
        ok = isinstance(probe_batch_size, int) and not isinstance(probe_batch_size, bool)
        ok = ok and probe_batch_size >= 1  # type: ignore[operator]
    if not ok:
        raise ValueError(
            "probe_batch_size must be a number of rows (an int >= 1) or a share of the batch "
            f"(a float in (0, 1]; 1.0 probes the whole batch), got {probe_batch_size!r}"
        )
    return probe_batch_size  # type: ignore[return-value]


def sub_batch(batch: Any, probe_batch_size: int | float = DEFAULT_PROBE_SHARE) -> Any:
    """The rows of ``batch`` that the probes replay (NOTE [Sub-batch probes]); ``batch``
    itself when that is all of it or the batch holds no tensor.

    Example::

        >>> batch = {"input_ids": torch.zeros(8, 5), "labels": torch.zeros(8, 5), "n": 3}
        >>> {k: getattr(v, "shape", v) for k, v in sub_batch(batch).items()}
        {'input_ids': torch.Size([2, 5]), 'labels': torch.Size([2, 5]), 'n': 3}
    """
    cut_rows = _cut(batch, probe_batch_size)
    if cut_rows is None:
        return batch
    rows, size = cut_rows

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[:size] if value.dim() > 0 and value.shape[0] == rows else value
        if isinstance(value, Mapping):
            items = {k: cut(v) for k, v in value.items()}
            try:
                return type(value)(items)
            except TypeError:
                return items
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*(cut(v) for v in value))
        if isinstance(value, (list, tuple)):
            return type(value)(cut(v) for v in value)
        return value

    return cut(batch)


def sub_batch_fraction(batch: Any, probe_batch_size: int | float = DEFAULT_PROBE_SHARE) -> float:
    """The share of ``batch``'s rows that ``sub_batch(batch, probe_batch_size)`` keeps."""
    cut_rows = _cut(batch, probe_batch_size)
    return 1.0 if cut_rows is None else cut_rows[1] / cut_rows[0]


def _cut(batch: Any, probe_batch_size: int | float) -> tuple[int, int] | None:
    """The rows of ``batch`` (its first tensor's first dimension) and the probes' rows, if
    they are fewer; else ``None``."""
    first = _first_tensor(batch)
    if first is None or first.dim() == 0:
        return None
    rows = first.shape[0]
    size = probe_rows(rows, probe_batch_size)
    return (rows, size) if size < rows else None


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    children = value.values() if isinstance(value, Mapping) else value
    if isinstance(value, (Mapping, list, tuple)):
        for child in children:
            found = _first_tensor(child)
            if found is not None:
                return found
    return None


class CallbackBase:
    """What every framework's ``GactCallback`` holds: its configuration, and its session once
    training has started.

    Args:
        config: a level name (``"L2"``) or a ``gact.GactConfig``.
        probe_batch_size: sensitivity probes replay the first this many rows of the step's last
            batch (an int), or this share of them (a float in ``(0, 1]``; ``1.0``: all of it;
            default a quarter, NOTE [Sub-batch probes]).

    Raises:
        ValueError: ``probe_batch_size`` is neither.
    """

    _STARTED_BY = "training"  # the call that starts training, for messages

    def __init__(
        self, config: ConfigLike = "L2", probe_batch_size: int | float = DEFAULT_PROBE_SHARE
    ) -> None:
        self.probe_batch_size = _check_probe_batch_size(probe_batch_size)
        self.config = resolve_config(config)
        self._session: TrainingSession | None = None

    @property
    def controller(self) -> Controller:
        """The ``Controller`` (``stats()``, ``report()``), from the start of training on.

        Raises:
            IntegrationError: before training started.
        """
        return self._started().controller

    def _started(self) -> TrainingSession:
        if self._session is None:
            raise IntegrationError(
                f"GactCallback.controller exists once {self._STARTED_BY} has started training; "
                "read it during or after training"
            )
        return self._session
