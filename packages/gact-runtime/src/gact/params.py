"""Recognising parameters and buffers among saved tensors."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ParameterFilter"]

# NOTE [Parameters are state]
# Parameters and buffers are state, not activations: they are never compressed. They are
# recognised three ways, so that ``model.to(...)`` and autocast cannot fool the check:
# - the tensor is an ``nn.Parameter`` (of any model) or one of the model's parameters or
#   buffers (sparse buffers included);
# - its storage is the storage of one of the model's parameters or buffers (views such as
#   ``weight.t()``, BatchNorm running statistics); the storage set is refreshed at every root
#   forward, so it follows ``model.to(device)``;
# - its autograd history leads, through casts and views only, to the ``AccumulateGrad`` of an
#   ``nn.Parameter`` (the weight copies that autocast makes), of this model or any other.
# A frozen parameter (``requires_grad=False``) cast by autocast has no history and is not
# recognised; it is then compressed like an activation. This is documented in the README.

# Autograd nodes that neither compute nor mix values: a cast or a view of their input.
_CAST_OR_VIEW = frozenset(
    {
        "ToCopyBackward0",
        "TBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "PermuteBackward0",
        "TransposeBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "AliasBackward0",
        "SliceBackward0",
        "SelectBackward0",
    }
)
_MAX_DEPTH = 8


def _storage(tensor: torch.Tensor) -> int:
    """The data pointer of ``tensor``'s storage (of its local shard for a DTensor); 0 if none."""
    local = getattr(tensor, "to_local", None)  # FSDP2 / tensor-parallel parameters
    if local is not None:
        tensor = local()
    if tensor.layout is not torch.strided or type(tensor) not in (torch.Tensor, nn.Parameter):
        return 0
    return tensor.untyped_storage().data_ptr()


class ParameterFilter:
    """Callable that says whether a saved tensor is a parameter or buffer of ``model``.

    Args:
        model: the model whose parameters and buffers are excluded from compression.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._state_ids: frozenset[int] = frozenset()
        self._storages: frozenset[int] = frozenset()
        self.refresh()

    def refresh(self) -> None:
        """Re-read the model's parameters and buffers (call after ``model.to``)."""
        state = [*self._model.parameters(), *self._model.buffers()]  # one walk of each
        self._state_ids = frozenset(map(id, state))
        self._storages = frozenset(ptr for t in state if (ptr := _storage(t)))

    def __call__(self, tensor: torch.Tensor) -> bool:
        # (a plain tensor skips the isinstance check, which runs Parameter's Python metaclass)
        if id(tensor) in self._state_ids or (
            type(tensor) is not torch.Tensor and isinstance(tensor, nn.Parameter)
        ):
            return True
        if tensor.layout is torch.strided and tensor.untyped_storage().data_ptr() in self._storages:
            return True
        node = tensor.grad_fn
        for _ in range(_MAX_DEPTH):
            if node is None:
                return False
            name = type(node).__name__
            if name == "AccumulateGrad":
                variable = node.variable
                return isinstance(variable, nn.Parameter) or id(variable) in self._state_ids
            if name not in _CAST_OR_VIEW:
                return False
            parents = [fn for fn, _ in node.next_functions if fn is not None]
            if len(parents) != 1:
                return False
            node = parents[0]
        return False
