"""``Controller.state_dict`` / ``load_state_dict``: a resumed run goes on as the uninterrupted one
(NOTE [Resumed runs] in resume.py)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from gact import ConfigError, Controller, GactConfig, HookStateError
from torch import nn

STEPS, SAVED_AT = 8, 4


def _config(level: str) -> GactConfig:
    return GactConfig.from_level(
        level, adapt_first_gap=1, adapt_interval=2, adapt_budget=None, min_numel=0
    )


class _Model(nn.Module):
    """An MLP with LayerNorm, GELU, dropout and BatchNorm, and a block that runs on odd steps
    only (NOTE [Keys the step did not save] in adapt.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64),
            nn.BatchNorm1d(64), nn.ReLU(),
        )  # fmt: skip
        self.extra = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        h = self.body(x)
        return self.head(self.extra(h) if extra else h)


def _model() -> nn.Module:
    return _Model()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(32, 16, generator=generator), torch.randint(0, 4, (32,), generator=generator)


def _timeless(state: dict) -> dict:
    """A run state without the seconds it measured (they differ between any two runs)."""
    return {
        k: _timeless(v) if isinstance(v, dict) else v
        for k, v in state.items()
        if "seconds" not in k
    }


def _train(level: str, steps: range, state: dict | None, *, resume: bool = True) -> dict:
    """Train ``steps`` from ``state`` (a checkpoint: model, optimizer, RNG, GACT; ``resume``:
    GACT's too), or from the start; returns the checkpoint after the last step."""
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    controller = Controller(model, _config(level))
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        if resume:
            controller.load_state_dict(state["gact"])
    with controller:
        for step in steps:
            x, y = _batch(step)

            def closure(
                x: torch.Tensor = x, y: torch.Tensor = y, extra: bool = step % 2 == 1
            ) -> torch.Tensor:
                loss = F.cross_entropy(model(x, extra), y)
                optimizer.zero_grad()
                loss.backward()
                return loss

            controller.iterate(closure)
            optimizer.step()
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state(), "gact": controller.state_dict(),
        },
        buffer,
    )  # fmt: skip
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("level", ["L1", "L2", "L2.2"])
def test_a_resumed_run_goes_on_as_the_uninterrupted_one(level: str) -> None:
    """Saved after step 4 with the model's, optimizer's and RNG's state and resumed by a new
    Controller, 8 steps give bit-identical parameters, widths and sensitivities to 8 steps in
    one go (adaptations at steps 1, 3, 5 and 7 at the adaptive levels). A new Controller
    without the state started at step 0: every rounding seed and the whole schedule of
    adaptations differed."""
    whole = _train(level, range(STEPS), None)
    half = _train(level, range(SAVED_AT), None)
    resumed = _train(level, range(SAVED_AT, STEPS), half)
    for name, value in whole["model"].items():
        assert torch.equal(value, resumed["model"][name]), name
    assert _timeless(resumed["gact"]) == _timeless(whole["gact"])
    if level != "L1":
        assert whole["gact"]["adapter"]["count"] == 4
    fresh = _train(level, range(SAVED_AT, STEPS), half, resume=False)
    assert not all(torch.equal(v, fresh["model"][k]) for k, v in whole["model"].items())


def test_a_state_is_checked_before_it_is_loaded() -> None:
    """Bad input raises a clear error and leaves the Controller as it was."""
    model = _model()
    state = _train("L2", range(2), None)["gact"]
    controller = Controller(model, _config("L2"))
    with pytest.raises(ValueError, match="not a GACT run state"):
        controller.load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="lacks"):
        controller.load_state_dict({k: v for k, v in state.items() if k != "bits"})
    adapter = {k: v for k, v in state["adapter"].items() if k != "count"}
    with pytest.raises(ValueError, match=r"lacks \['adapter.count'\]"):  # before any change
        controller.load_state_dict({**state, "adapter": adapter})
    with pytest.raises(ConfigError, match="memory_budget: None there, 5000 here"):
        Controller(model, _config("L2").replace(memory_budget=5000)).load_state_dict(state)
    assert controller.plan.step == 0 and not controller.plan.bits
    with controller:
        model(torch.randn(8, 16), False).sum().backward()
        with pytest.raises(HookStateError, match="middle of a step"):
            controller.load_state_dict(state)
        controller.step()
    controller.load_state_dict(state)
    assert controller.plan.step == state["step"] == 2


def test_a_resumed_loop_that_accumulates_keeps_its_steps() -> None:
    """A plain loop with two micro-batches per ``step()``: until its first boundary a
    Controller splits a step at the second forward (NOTE [Steps]). A resumed Controller did so
    again, counting the first step after resuming as two and shifting every later seed (the
    weights 0.004 off the uninterrupted run's); the state now says the loop marks its steps."""

    def train(steps: range, state: dict | None) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        controller = Controller(model, GactConfig.from_level("L1", min_numel=0))
        if state is not None:
            model.load_state_dict(state["model"])
            controller.load_state_dict(state["gact"])
        with controller:
            for step in steps:
                optimizer.zero_grad()
                for half in range(2):
                    x, y = _batch(2 * step + half)
                    F.cross_entropy(model(x), y).backward()
                optimizer.step()
                controller.step()
        return {"model": model.state_dict(), "gact": controller.state_dict()}

    whole = train(range(6), None)
    resumed = train(range(3, 6), train(range(3), None))
    assert resumed["gact"]["step"] == whole["gact"]["step"]
    assert all(torch.equal(v, resumed["model"][k]) for k, v in whole["model"].items())
