"""Stable names for saved tensors.

# NOTE [Save-site keys]
# A saved tensor is named by *where* it was saved, not by when: the qualified name of the
# innermost module running at that moment, the index of the save within that module's current
# call, and the tensor's dtype and rank, e.g. ``layer1.0.conv2#1:float32:4d``. Saves made outside
# every module of the model (a loss computed after ``model(x)``) are named under ``<outside>``,
# whose counter restarts whenever the model's root forward starts.
#
# Why: the original GACT numbered saves in forward order at step 0, which shifts as soon as a
# layer is skipped (dynamic control flow), a model is called twice before one backward
# (gradient accumulation), a region is recomputed (checkpointing) or a backward is skipped.
# Module-relative indices are unaffected by all of these: a skipped layer only removes its own
# keys, and a second forward reproduces the same keys. The shape is left out on purpose, so a
# smaller last batch keeps its bits; dtype and rank are in, so a save site whose tensor changes
# kind gets a key of its own rather than another tensor's bits.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["OUTSIDE", "ScopeTracker"]

OUTSIDE = "<outside>"


class _Frame:
    __slots__ = ("count", "module", "name")

    def __init__(self, module: nn.Module | None, name: str) -> None:
        self.module = module
        self.name = name
        self.count = 0


class ScopeTracker:
    """Tracks the innermost running module of ``model`` and names saves within it.

    Args:
        model: the model whose modules are tracked (submodules included).
        on_root_forward: called whenever the model's own forward starts.

    Example::

        >>> tracker = ScopeTracker(model, on_root_forward=lambda: None)
        >>> tracker.attach()
        >>> key = tracker.next_key(tensor)   # inside a forward
        >>> tracker.detach()
    """

    def __init__(self, model: nn.Module, on_root_forward: Callable[[], None]) -> None:
        self._model = model
        self._on_root_forward = on_root_forward
        self._local = threading.local()
        self._handles: list[RemovableHandle] = []
        self._generation = 0  # bumped at every root forward

    def _stack(self) -> list[_Frame]:
        local = self._local
        stack = getattr(local, "stack", None)
        if stack is None:
            stack = local.stack = [_Frame(None, OUTSIDE)]
            local.generation = self._generation
        elif local.generation != self._generation:
            # Another thread (e.g. an autograd worker recomputing a checkpointed region) saw a
            # root forward start since: its <outside> counter restarts like the main thread's.
            stack[0].count = 0
            local.generation = self._generation
        return stack

    def attach(self) -> None:
        """Register forward pre/post hooks on every module of the model."""
        if self._handles:
            return
        for name, module in self._model.named_modules():
            label = name or "<root>"
            self._handles.append(module.register_forward_pre_hook(self._make_enter(label)))
            self._handles.append(module.register_forward_hook(self._make_exit(), always_call=True))

    def detach(self) -> None:
        """Remove the hooks; the tracker can be attached again later."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._local = threading.local()

    def _make_enter(self, label: str):
        def enter(module: nn.Module, args: object) -> None:
            if module is self._model:
                self._generation += 1
                self._on_root_forward()
            stack = self._stack()
            stack.append(_Frame(module, label))

        return enter

    def _make_exit(self):
        def leave(module: nn.Module, args: object, output: object) -> None:
            stack = self._stack()
            # Pop up to and including this module's frame (a frame left behind by an
            # exception in a hook of a submodule is discarded with it).
            for depth in range(len(stack) - 1, 0, -1):
                if stack[depth].module is module:
                    del stack[depth:]
                    return

        return leave

    @property
    def generation(self) -> int:
        """Number of root forwards so far (identifies the current forward)."""
        return self._generation

    def next_key(self, tensor: torch.Tensor) -> str:
        """The key of the next save in the current scope (advances the scope's counter)."""
        frame = self._stack()[-1]
        index = frame.count
        frame.count += 1
        dtype = str(tensor.dtype).removeprefix("torch.")
        return f"{frame.name}#{index}:{dtype}:{tensor.dim()}d"
