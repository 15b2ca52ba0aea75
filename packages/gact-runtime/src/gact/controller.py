"""The ``Controller``: installs GACT's hooks on a model and drives adaptation.

# NOTE [Steps]
# A *step* is everything between two step boundaries: ``iterate`` ends one itself, and a plain
# training loop calls ``controller.step()`` after ``optimizer.step()`` (like an LR scheduler).
# Several forwards in one step (gradient accumulation) are accounted together. ``stats()`` and
# ``report()`` describe the last completed step (the open one until a step completes). The
# adaptive levels re-estimate sensitivities on the steps where ``step % adapt_interval == 0``;
# that needs ``iterate``'s closure, so a plain loop at an adaptive level keeps its last
# allocation (or the level's default width) until an ``iterate`` call adapts.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from .adapt import Adapter
from .config import GactConfig, get_config
from .errors import ClosureError, HookStateError
from .ledger import Ledger
from .params import ParameterFilter
from .plan import BitPlan
from .saved import SaveHooks
from .scope import ScopeTracker
from .swap import Swapper

__all__ = ["Controller"]


def _top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost saved-tensor hooks pair, or ``None`` where torch cannot tell (< 2.4)."""
    getter = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if getter is None else getter(False)


logger = logging.getLogger("gact")
T = TypeVar("T")


class Controller:
    """Compresses the activations that autograd saves while ``model`` trains.

    Args:
        model: the model to train. Its parameters and buffers are never compressed.
        config: a ``GactConfig``; ``None`` takes the default set by
            ``gact.set_optimization_level``.

    Example::

        >>> gact.set_optimization_level("L2")
        >>> controller = Controller(model)
        >>> controller.install_hook()
        >>> for x, y in loader:
        ...     def closure():
        ...         model.train()
        ...         loss = loss_fn(model(x), y)
        ...         optimizer.zero_grad()
        ...         loss.backward()
        ...         return loss
        ...     controller.iterate(closure)
        ...     optimizer.step()
        >>> controller.uninstall_hook()

    Fixed-bit levels need no closure: ``with controller:`` around a plain loop that calls
    ``controller.step()`` after each optimizer step.
    """

    def __init__(self, model: nn.Module, config: GactConfig | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if config is not None and not isinstance(config, GactConfig):
            raise TypeError(
                f"config must be a gact.GactConfig or None, got {type(config).__name__}; "
                "build one with GactConfig.from_level('L2', ...)"
            )
        if next(model.parameters(), None) is None:
            raise ValueError(
                "model has no parameters: there is nothing to train, so GACT has nothing to do"
            )
        self.model = model
        self.plan = BitPlan(config if config is not None else get_config())
        self.ledger = Ledger()
        self.parameters = ParameterFilter(model)
        self.tracker = ScopeTracker(model, on_root_forward=self._on_root_forward)
        self.hooks = SaveHooks(
            self.plan, self.tracker, self.parameters, self.ledger, self._make_swapper()
        )
        self.adapter = Adapter(model, self.plan, self.hooks)
        self._context: torch.autograd.graph.saved_tensors_hooks | None = None
        self._seconds = 0.0

    def _on_root_forward(self) -> None:
        self.parameters.refresh()  # follows model.to(...)
        self.hooks.live.clear()

    # ----------------------------------------------------------------- configuration
    @property
    def config(self) -> GactConfig:
        return self.plan.config

    def configure(self, config: GactConfig | str) -> None:
        """Change the configuration (or just the level) between steps.

        Raises:
            HookStateError: if the open step already saved tensors (a level change mid-step).
        """
        if isinstance(config, str):
            config = self.config.replace(level=config)
        elif not isinstance(config, GactConfig):
            raise TypeError(f"config must be a GactConfig or a level name, got {config!r}")
        if self.ledger.current:
            raise HookStateError(
                "cannot change the configuration in the middle of a step (tensors were saved "
                "since the last step boundary); call controller.step() first"
            )
        self.plan.config = config
        self.plan.bits.clear()
        self.hooks.swapper = self._make_swapper()

    def _make_swapper(self) -> Swapper | None:
        return Swapper() if self.config.spec.swap else None

    # ----------------------------------------------------------------- hooks
    @property
    def installed(self) -> bool:
        return self._context is not None

    def install_hook(self) -> None:
        """Start compressing: push GACT's saved-tensor hooks (thread-local, like torch's)."""
        if self._context is not None:
            raise HookStateError("install_hook() was called twice; call uninstall_hook() first")
        self.parameters.refresh()
        self.tracker.attach()
        context = torch.autograd.graph.saved_tensors_hooks(self.hooks.pack, self.hooks.unpack)
        context.__enter__()
        self._context = context

    def uninstall_hook(self) -> None:
        """Stop compressing. Tensors saved so far stay compressed and still unpack correctly."""
        if self._context is None:
            raise HookStateError("uninstall_hook() called but the hooks are not installed")
        top = _top_saved_tensors_hooks()
        if top is not None and top[0] != self.hooks.pack:
            raise HookStateError(
                "another saved_tensors_hooks context was entered after install_hook() and is "
                "still active; exit it before uninstall_hook()"
            )
        self._context.__exit__(None, None, None)
        self._context = None
        self.tracker.detach()

    def __enter__(self) -> Controller:
        self.install_hook()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall_hook()

    # ----------------------------------------------------------------- training
    def iterate(
        self, closure: Callable[[], T], *, probe_closure: Callable[[], Any] | None = None
    ) -> T:
        """Run one training step's forward and backward, adapting bits when due.

        Args:
            closure: runs forward, loss, ``optimizer.zero_grad()`` and ``loss.backward()``.
            probe_closure: the same on a sub-batch, used for sensitivity probes (default:
                ``closure``). Probes restore RNG states, buffers, gradients and module modes.

        Returns:
            What ``closure`` returned.
        """
        if self._context is None:
            raise HookStateError("iterate() called before install_hook()")
        start = time.perf_counter()
        try:
            result = self.run_closure(closure)
        except BaseException:
            self.ledger.discard()
            raise
        try:
            if self.config.spec.adaptive and self.plan.step % self.config.adapt_interval == 0:
                self.adapter.adapt(probe_closure or closure, self.ledger.current, self.run_closure)
        finally:  # a failed adaptation still ends the step the real closure completed
            self._seconds += time.perf_counter() - start
            self.step()
        return result

    def run_closure(self, closure: Callable[[], T]) -> T:
        """Run ``closure`` and check that it ran a backward pass through the hooks."""
        if not callable(closure):
            raise TypeError(f"closure must be callable, got {type(closure).__name__}")
        before = self.hooks.unpacked
        grads = [
            (p.grad, None if p.grad is None else p.grad._version) for p in self.model.parameters()
        ]
        result = closure()
        if self.hooks.unpacked == before and all(
            p.grad is g and (g is None or g._version == v)
            for p, (g, v) in zip(self.model.parameters(), grads)
        ):
            raise ClosureError(
                "the closure did not run a backward pass: it must compute the loss and call "
                "loss.backward() (after optimizer.zero_grad())"
            )
        return result

    def step(self) -> None:
        """Close the current step (``iterate`` calls this; plain loops call it per step)."""
        self.ledger.close()
        self.plan.step += 1
        if self.hooks.swapper is not None:
            self.hooks.swapper.new_step()

    # ----------------------------------------------------------------- reports
    def stats(self) -> dict[str, Any]:
        """Accounting of the last completed step.

        Returns:
            ``original_bytes`` (saved activations uncompressed), ``stored_bytes`` (held,
            metadata included), ``ratio``, ``compressed_tensors``, ``skipped_tensors``,
            ``parameter_saves``, ``deduplicated_saves``, ``average_bits``, ``sites``, ``level``,
            ``step``, ``adaptations`` and ``adaptation_overhead`` (time spent adapting divided by
            the rest of ``iterate``'s time).
        """
        out = self.ledger.stats()
        training = self._seconds - self.adapter.seconds
        out.update(
            level=self.config.level,
            step=self.plan.step,
            adaptations=self.adapter.count,
            adaptation_overhead=self.adapter.seconds / training if training > 0 else 0.0,
        )
        return out

    def report(self) -> str:
        """A per-tensor table of the last completed step (key, shape, dtype, bits, ...)."""
        return self.ledger.table(self.plan.sensitivity)
