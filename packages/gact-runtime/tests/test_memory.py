"""No growth over many steps: every per-step structure is bounded and freed."""

from __future__ import annotations

import gc
import tracemalloc

import torch
from gact import Controller, GactConfig
from gact.saved import Saved
from models import make_case
from runtime_helpers import make_closure


def test_no_memory_growth_over_500_steps() -> None:
    model, x, y = make_case("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    closure = make_closure(model, x, y)
    cfg = GactConfig.from_level(
        "L2", min_numel=0, adapt_interval=100, adapt_first_gap=0, adapt_budget=None
    )
    tracemalloc.start()
    with Controller(model, cfg) as controller:
        for step in range(500):
            controller.iterate(closure)
            optimizer.step()
            if step == 99:
                gc.collect()
                baseline, _ = tracemalloc.get_traced_memory()
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert controller.stats()["adaptations"] == 5
        assert len(controller.hooks.live) <= 2  # only x and y, which the test still holds
        assert len(controller.ledger.current) == 0 and len(controller.ledger.last) <= 8
        assert len(controller.plan.bits) <= 8
    assert not [o for o in gc.get_objects() if isinstance(o, Saved)]
    # Python-side allocations of the runtime (ledger, plans, tables) do not grow with steps.
    assert current - baseline < 256 * 1024, (baseline, current)
