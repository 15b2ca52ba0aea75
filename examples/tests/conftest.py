"""Fixtures of the examples' tests: tiny datasets on disk, the scripts as modules, an isolated
cache. Shared helpers live in ``gact_examples.testing``; tests never import this file."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from gact_examples.testing import make_all

EXAMPLES_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding tiny mnist/, cora/, cifar10-jpg/ and tinyshakespeare/ datasets."""
    return make_all(tmp_path_factory.mktemp("data"))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GACT_EXAMPLES_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def script() -> Callable[[str], ModuleType]:
    """Load an example script (a path under ``examples/``, e.g. ``"gnn/train_gnn.py"``) as a
    module, so that a test can call its ``main(argv)``."""
    loaded: dict[str, ModuleType] = {}

    def load(relpath: str) -> ModuleType:
        if relpath not in loaded:
            path = EXAMPLES_DIR / relpath
            spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
            assert spec is not None and spec.loader is not None, path
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            loaded[relpath] = module
        return loaded[relpath]

    return load
