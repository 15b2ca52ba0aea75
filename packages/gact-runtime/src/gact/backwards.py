"""Whether a backward of the controlled model ran: what ``Controller.iterate`` and its
closure check read (NOTE below)."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .hooks import SaveHooks

__all__ = ["BackwardsSeen", "Marks"]

# NOTE [Backwards seen]
# ``iterate`` must know whether the open step already ran its backward (the original GACT loop
# runs forward, backward and ``optimizer.step()`` itself, then ``iterate(backprop)``), and a
# closure must be checked to run one. GACT's own unpack hooks tell, but a compiled graph whose
# saves GACT keeps all (level L0, or each below ``min_numel``) runs no GACT code at all: on such
# a model ``iterate`` ran ``backprop`` again, and the gradients it added to those of the step
# (transformers' ``training_step`` zeroes none) doubled the next ``optimizer.step()``'s. So while
# installed, every parameter that requires grad counts the gradients accumulated into it (a
# post-accumulate-grad hook, one Python call per parameter and backward); a framework that
# zeroes the gradients before ``iterate`` (the Trainer's ``on_step_end``) leaves the count. A
# closure that sets ``p.grad`` itself (``torch.autograd.grad``) shows in the gradients written
# since the step began (weak references, ``BackwardsSeen.mark``), and so do parameters that came to
# require grad after ``install_hook()`` (no hook; their gradients' versions too). A counted
# parameter's version is not read: gradient clipping and ``GradScaler.unscale_`` rescale
# gradients in place between a step's backward and ``optimizer.step()``, after ``iterate`` ended
# the step, and read as a backward of the next step they made ``iterate`` skip every closure.
# And each save counts its unpacks on the controller whose model saved it (``Saved.owner``,
# ``SaveHooks.unpacked_inside``), not on the innermost hooks that unpack it: another model's
# backward between steps (a GAN's discriminator, controlled or not) unpacked its own saves
# through the generator's hooks, and the generator's closure was skipped at every step.
#: ``BackwardsSeen.mark``: unpacks of the model's saves, gradients accumulated, and which
#: gradient each parameter holds (a weak reference, and its version where no hook counts)
Marks = tuple[int, int, list[tuple["weakref.ref[torch.Tensor] | None", "int | None"]]]


class BackwardsSeen:
    """Tells whether a backward of ``model`` ran since a mark (NOTE [Backwards seen]).

    Args:
        model: the controlled model.
        hooks: its controller's save hooks, which count the unpacks of the model's saves.
    """

    def __init__(self, model: nn.Module, hooks: SaveHooks) -> None:
        self._model = model
        self._hooks = hooks
        # gradients accumulated into the parameters while attached: a list, so that the hooks
        # counting them hold no reference to this object
        self._accumulated = [0]
        self._handles: list[RemovableHandle] = []
        self._counted: set[int] = set()  # ``id()`` of the parameters whose hooks count
        self.boundary = self.mark()  # at the last step boundary

    def attach(self) -> None:
        """Count the gradients accumulated into every parameter that requires grad now."""
        counter = self._accumulated

        def count(param: torch.Tensor) -> None:
            counter[0] += 1

        counted = [p for p in self._model.parameters() if p.requires_grad]
        self._handles = [p.register_post_accumulate_grad_hook(count) for p in counted]
        self._counted = set(map(id, counted))

    def detach(self) -> None:
        """Remove the counting hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._counted = set()

    def mark(self) -> Marks:
        """Where the counts stand now. Weak references to the gradients: a strong one would
        keep the last step's gradients alive through a ``zero_grad()``, one more copy of every
        gradient at the step's peak."""
        return (
            self._hooks.unpacked_inside,
            self._accumulated[0],
            [
                (None, None)
                if p.grad is None
                else (weakref.ref(p.grad), None if id(p) in self._counted else p.grad._version)
                for p in self._model.parameters()
            ],
        )

    def ran_since(self, marks: Marks, *, unpacks: bool = True) -> bool:
        """Whether a backward of the model ran since ``marks``: its saves unpacked (read only
        if ``unpacks``), gradients accumulated into its parameters, or a gradient set anew or,
        where no hook counts, changed in place."""
        unpacked, accumulated, grads = marks
        if (unpacks and self._hooks.unpacked_inside > unpacked) or (
            self._accumulated[0] > accumulated
        ):
            return True
        return any(
            p.grad is not None
            and (ref is None or ref() is not p.grad or (v is not None and p.grad._version != v))
            for p, (ref, v) in zip(self._model.parameters(), grads)
        )
