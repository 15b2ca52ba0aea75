from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


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


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    """Fixed RNG, and no test may leave saved-tensor hooks installed behind it."""
    torch.manual_seed(0)
    yield
    leaked = torch._C._autograd._top_saved_tensors_default_hooks(False)
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    assert leaked is None, "the test left saved-tensor hooks installed"
