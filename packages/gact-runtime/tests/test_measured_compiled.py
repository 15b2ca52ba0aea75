"""The saves of compiled graphs are measured, not probed (NOTE [Measured compiled saves] in
measured_compiled.py): an eager run of the step's closure measures them, and each compiled
save takes the measurement of the eager save holding the same values."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from gact import Controller, GactConfig
from gact.measured_compiled import fingerprint, match
from runtime_helpers import BACKENDS
from torch import nn

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
    )  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 3, 8, 8, generator=gen), torch.randint(0, 10, (32,), generator=gen)


def _adapt(model: nn.Module, run: nn.Module, steps: int, **options) -> Controller:
    """``steps`` steps of L2 on one batch without weight updates (an adaptation at step 1)."""
    x, y = _batch()

    def closure() -> torch.Tensor:
        loss = F.cross_entropy(run(x), y)
        model.zero_grad()
        loss.backward()
        return loss

    config = GactConfig.from_level("L2", adapt_first_gap=1, adapt_budget=None, **options)
    controller = Controller(run, config)
    with controller:
        for _ in range(steps):
            controller.iterate(closure)
    return controller


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spelling", ["Controller(torch.compile(model))", "model.compile()"])
def test_compiled_saves_are_measured_as_eager_code_measures_them(
    backend: str, spelling: str
) -> None:
    """Every quantized save of the compiled CNN (convolution inputs, BatchNorm inputs) is
    measured, with the sensitivity eager code measures for the same tensor; nothing is
    probed, and measuring compiles nothing."""
    model = _cnn()
    eager = _adapt(model, model, 2)
    compiled_model = run = _cnn()
    if spelling == "model.compile()":
        compiled_model.compile(backend=backend)
    else:
        run = torch.compile(compiled_model, backend=backend)
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"]["unique_graphs"]
    controller = _adapt(compiled_model, run, 2)  # step 0 allocates, step 1 measures and adapts
    assert controller.stats()["adaptations"] == 1
    records = controller.ledger.last
    items = {k for k, r in records.items() if "@" in k and r.kind.name == "QUANTIZED"}
    assert len(items) >= 5 and items <= controller.plan.measured  # none probed
    assert counters["stats"]["unique_graphs"] == graphs + 1  # the eager run compiled nothing
    assert controller.stats()["compiled_graphs"] == 1
    theirs = sorted(v for k, v in eager.plan.sensitivity.items() if k in eager.plan.measured)
    ours = sorted(controller.plan.sensitivity[k] for k in items)
    nonzero = [v for v in theirs if v > 0]
    # the compiled graph saves the nonzero-sensitivity tensors eager code saves
    assert len([v for v in ours if v > 0]) == len(nonzero)
    # within 2%: each measures the rounding of its own grid (the eager run stores every save
    # at the level's width, the eager model at its prior allocation's: 0.8% apart at most)
    assert [v for v in ours if v > 0] == pytest.approx(nonzero, rel=0.02)


def test_values_the_eager_run_never_saves_stay_with_the_probes() -> None:
    """After dropout the eager run draws other masks: the saves there fit no eager save and are
    probed, while the input before it is measured."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 64), nn.Linear(64, 10)
    )
    run = torch.compile(model, backend="aot_eager")
    x = torch.randn(64, 64)
    config = GactConfig.from_level("L2", adapt_first_gap=1, adapt_budget=None)
    with Controller(run, config) as controller:
        for _ in range(2):
            controller.iterate(lambda: run(x).square().mean().backward())
    records = controller.ledger.last
    items = {k for k, r in records.items() if "@" in k and r.kind.name == "QUANTIZED"}
    measured = items & controller.plan.measured
    assert any("primals" in k for k in measured)  # the model's input, before any dropout
    assert items - measured  # a save after the dropout
    assert controller.stats()["adaptations"] == 1


def test_the_eager_run_leaves_no_trace() -> None:
    """The measuring step's gradients, BatchNorm statistics and RNG state are those of the
    same step without measuring (``measure_linear=False``): the eager run is a probe."""
    out = []
    for measure in (True, False):
        model = _cnn()
        run = torch.compile(model, backend="aot_eager")
        controller = _adapt(model, run, 2, measure_linear=measure)
        assert controller.stats()["adaptations"] == 1
        grads = [p.grad.clone() for p in model.parameters()]
        out.append((grads, copy.deepcopy(model.state_dict()), torch.rand(3)))
        torch._dynamo.reset()
    (g1, s1, r1), (g2, s2, r2) = out
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert torch.equal(r1, r2)


def test_fingerprints_match_a_compiled_key_to_the_eager_keys_of_its_values() -> None:
    """A compiled key takes the eager keys whose saves hold its saves' values (within the
    rounding of the backend's numerics, in any shape), if no other compiled key fits them."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    near = a * (1 + 1e-6)
    eager = {"e#0": [fingerprint(a)], "e#1": [fingerprint(b)], "e#2": [fingerprint(b.t())]}
    compiled = {
        "c@x": [fingerprint(near.t())],
        "c@y": [fingerprint(b)],
        "c@z": [fingerprint(a[:32])],
    }
    # c@y holds what two eager keys held (read by both); c@z has fewer elements
    assert match(compiled, eager) == {"c@x": ["e#0"], "c@y": ["e#1", "e#2"]}
    assert match({"c@x": [fingerprint(a.double())]}, eager) == {}  # another dtype
    twice = {"c@x": [fingerprint(a)], "c@w": [fingerprint(near)]}
    assert match(twice, eager) == {}  # two compiled keys on one eager key: neither
    assert match({"c@x": [fingerprint(a), fingerprint(b)]}, eager) == {}  # other saves
    assert match({"c@x": [fingerprint(a + 1e-2)]}, eager) == {}  # other values
