"""Fixtures of the integration tests (transformers, Lightning, PyG); the runtime's conftest one
folder up adds the check that no test leaves saved-tensor hooks installed."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

# torchvision cannot be imported with the CPU torch these tests run on, and transformers imports
# it for some models whenever it is installed. A ``None`` entry makes ``import torchvision`` fail
# and ``importlib.util.find_spec`` report it absent, so transformers never tries.
if "torchvision" not in sys.modules:
    sys.modules["torchvision"] = None  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: these models are tiny, and on a shared machine several threads
    spin against each other (a 2-layer GPT-2 step takes 50x longer with 2 busy threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
