"""Fixtures of the runtime tests; shared helpers live in ``runtime_helpers`` and ``models``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    """Fixed RNG, and no test may leave saved-tensor hooks installed behind it."""
    torch.manual_seed(0)
    yield
    leaked = torch._C._autograd._top_saved_tensors_default_hooks(False)
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    assert leaked is None, "the test left saved-tensor hooks installed"


@pytest.fixture
def fresh_dynamo() -> None:
    """Forget what dynamo compiled before the test (the compiled tests' modules use it for
    every test: ``pytestmark``)."""
    torch._dynamo.reset()
