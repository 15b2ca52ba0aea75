"""Helpers shared by the runtime tests (imported as a module; conftest puts this folder on
``sys.path``)."""

from __future__ import annotations

import math
from typing import Any, Callable

import gact_kernels
import pytest
import torch
import torch.nn.functional as F
from torch import nn

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not gact_kernels.compiled_with_cuda(),
    reason="needs a CUDA device and the gact_kernels._cuda module",
)


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)))
    den = math.sqrt(sum(float(y.pow(2).sum()) for y in b))
    return num / den


def make_closure(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, rng_seed: int = 123
) -> Callable[[], torch.Tensor]:
    """forward + cross-entropy + zero_grad + backward, with a fixed dropout stream."""

    def closure() -> torch.Tensor:
        torch.manual_seed(rng_seed)
        model.train()
        loss = F.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        return loss

    return closure


def record_saves(controller: Any, monkeypatch: Any) -> list[object]:
    """A list that receives what ``controller``'s hooks return for every save of its model
    (``SavedKept`` / ``SavedCompressed``), in order."""
    saved: list[object] = []
    pack = controller.hooks.pack_own

    def recording(tensor: torch.Tensor, **kwargs: Any) -> object:
        saved.append(pack(tensor, **kwargs))
        return saved[-1]

    monkeypatch.setattr(controller.hooks, "pack_own", recording)
    return saved
