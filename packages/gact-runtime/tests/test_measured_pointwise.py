"""GELU and SiLU inputs measured in the ordinary backward (NOTE [Measured pointwise inputs])."""

from __future__ import annotations

import gact_policy
import pytest
import torch
import torch.nn.functional as F
from gact import GactConfig
from gact.measured_pointwise import FURTHER_BACK
from gact.pointwise import DERIVATIVES, SECOND_DERIVATIVES
from runtime_helpers import measured_step, rounding_errors
from torch import nn

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


@pytest.mark.parametrize("function", sorted(SECOND_DERIVATIVES))
def test_second_derivatives_are_the_first_ones_differentiated(function: str) -> None:
    x = torch.linspace(-8, 8, 2001, dtype=torch.float64, requires_grad=True)
    (expected,) = torch.autograd.grad(DERIVATIVES[function][0](x).sum(), x)
    assert torch.allclose(SECOND_DERIVATIVES[function](x.detach()), expected, atol=1e-12)


class _Mlp(nn.Module):
    """``fc1`` -> activation -> ``fc2`` -> mean over positions; ``residual``: the activation
    reads ``fc1``'s output plus its input instead (no measured producer)."""

    def __init__(self, act: str, width: int = 32, residual: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, 10)
        self.act, self.residual = ACTIVATIONS[act], residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        out = self.fc2(self.act(h + x if self.residual else h))
        return out.mean(1) if out.dim() == 3 else out


def _case(act: str, rank: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model and a batch on a 4-level grid ({0, 1/9, 2/9, 1/3}: exact at 2 and 4 bits), so
    that only the activation's input's rounding reaches ``fc1``'s gradients; the rows' squared
    norms are about 1.4, so the bias's gradient carries 40% of their error."""
    torch.manual_seed(0)
    model = _Mlp(act)
    shape = (16, 12, 32) if rank == 3 else (192, 32)
    return model, torch.randint(0, 4, shape).float() / 9, torch.randint(0, 10, (shape[0],))


@pytest.mark.parametrize("rank", [3, 2], ids=["tokens", "rows"])
@pytest.mark.parametrize("level", ["L1", "L1.2"])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_measured_pointwise_inputs_predict_the_producer_weights_rounding_variance(
    act: str, level: str, rank: int
) -> None:
    """The measured sensitivity of a GELU/SiLU input that a linear layer produced, divided by
    ``FURTHER_BACK``, predicts ``E‖Δ grad‖²`` of that layer's weight and bias over 32 rounding
    seeds, whether the save is quantized (``derivative_tables=False``) or a derivative table
    (then the table's error, deterministic, is not what is predicted: only that the key is
    measured and its value the quantized one's). The term sums over blocks of rows and leaves
    out second-order terms: tolerance 4 standard errors of the empirical mean plus 15% of
    slack (false-alarm probability under the normal approximation below 1e-4)."""
    model, x, y = _case(act, rank)
    cfg = GactConfig.from_level(level, min_numel=100, derivative_tables=False)
    controller, meter = measured_step(model, cfg, lambda: F.cross_entropy(model(x), y).backward())
    assert not meter.probed, meter.probed
    stored = {key: r.bits for key, r in controller.ledger.view()[0].items()}
    measured = meter.sensitivities()
    (key,) = [k for k in measured if k.startswith("<root>#")]  # the activation's input
    predicted = measured[key] * gact_policy.variance_factor(stored[key]) / FURTHER_BACK
    mean, se = rounding_errors(model, x, y, cfg, ("fc1.weight", "fc1.bias"))
    assert abs(mean - predicted) <= 4 * se + 0.15 * predicted, (mean, se, predicted)
    # stored as a derivative table, the same key is still measured, to the same value
    _, tabled = measured_step(
        model, cfg.replace(derivative_tables=True), lambda: F.cross_entropy(model(x), y).backward()
    )
    assert not tabled.probed
    assert tabled.sensitivities()[key] == pytest.approx(measured[key], rel=0.2)


def test_pointwise_inputs_no_measured_layer_produced_are_probed() -> None:
    """A GELU reading a residual sum (its error travels back along paths the meter does not
    follow) leaves its input to the probes."""
    torch.manual_seed(0)
    model, x = _Mlp("gelu", residual=True), torch.randn(16, 12, 32)
    y = torch.randint(0, 10, (16,))
    cfg = GactConfig.from_level("L1", min_numel=100)
    _, meter = measured_step(model, cfg, lambda: F.cross_entropy(model(x), y).backward())
    assert [k.split("#")[0] for k in meter.probed] == ["<root>"]
    assert not any(k.startswith("<root>#") for k in meter.sensitivities())


def test_a_linear_output_modified_in_place_is_probed() -> None:
    """The producer's quantities describe its output as it returned: a GELU reading that
    tensor after an in-place change (a new version) is probed."""

    class _Shifted(_Mlp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc1(x)
            h.add_(1.0)
            return self.fc2(self.act(h)).mean(1)

    torch.manual_seed(0)
    model, x = _Shifted("gelu"), torch.randn(16, 12, 32)
    y = torch.randint(0, 10, (16,))
    _, meter = measured_step(
        model, GactConfig.from_level("L1", min_numel=100),
        lambda: F.cross_entropy(model(x), y).backward(),
    )  # fmt: skip
    assert [k.split("#")[0] for k in meter.probed] == ["<root>"]


def test_a_large_pointwise_input_is_read_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meter's temporaries for a GELU input (its rounding, ``f''``) cover slices of the
    batch, not the whole input (a transformer's largest save): a measuring step's forward
    peak on the char-GPT memory configuration was 241 MiB reading it whole, 211 in slices."""
    import gact.measured as measured

    read: list[int] = []
    whole = measured.rounding_variance

    def spy(payload, held):
        read.append(held.numel())
        return whole(payload, held)

    monkeypatch.setattr(measured, "rounding_variance", spy)
    torch.manual_seed(0)
    model, x = _Mlp("gelu", width=256), torch.randn(64, 64, 256)
    y = torch.randint(0, 10, (64,))
    cfg = GactConfig.from_level("L1", min_numel=100)
    _, meter = measured_step(model, cfg, lambda: F.cross_entropy(model(x), y).backward())
    assert "<root>#0:float32:3d" in meter.sensitivities()
    # the two linear layers' inputs are read whole (as large as the GELU's input here), the
    # GELU's input in slices
    assert sorted(read)[-2:] == [x.numel()] * 2 and len(read) > 3, read
    assert sum(sorted(read)[:-2]) == x.numel() and max(sorted(read)[:-2]) <= x.numel() // 4


def test_pointwise_inputs_are_measured_under_autocast() -> None:
    """Under a bf16 autocast the linear layer's output, the GELU's input, is bf16: it is
    measured all the same, in float32, to the fp32 run's value within the rounding of bf16."""
    model, x, y = _case("gelu", 3)
    cfg = GactConfig.from_level("L1", min_numel=100, derivative_tables=False)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()

    _, meter = measured_step(model, cfg, step)
    _, exact = measured_step(model, cfg, lambda: F.cross_entropy(model(x), y).backward())
    assert not meter.probed, meter.probed
    (key,) = [k for k in meter.sensitivities() if k.startswith("<root>#")]
    (reference,) = [v for k, v in exact.sensitivities().items() if k.startswith("<root>#")]
    assert key.split(":")[1] == "bfloat16"
    assert meter.sensitivities()[key] == pytest.approx(reference, rel=0.15)
