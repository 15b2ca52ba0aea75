"""Sensitivities measured in the ordinary backward (NOTE [Measured sensitivities])."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import gact_policy
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gact import Controller, GactConfig, GactWarning, linear_rules
from gact.decisions import DecisionMode, current_spec
from gact.ledger import Kind
from gact.measured import SensitivityMeter
from models import make_case
from runtime_helpers import (
    cross_entropy_grads,
    fake_clocks,
    make_closure,
    measured_step,
    rounding_errors,
)
from torch import nn


class _Reader(nn.Module):
    """An activation whose backward reads only decisions (after the first block), a reshape,
    then one linear reader of its input."""

    def __init__(
        self, op: nn.Module | nn.Parameter, first: bool = False, shape=None, act=F.relu
    ) -> None:
        super().__init__()
        self.first, self.shape, self.act = first, shape, act
        if isinstance(op, nn.Parameter):
            self.weight, self.op = op, None
        else:
            self.op = op

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.first:
            h = self.act(h)  # a ReLU's save is shared with the reader below
        if self.shape is not None:
            h = h.reshape(self.shape(h))
        if self.op is not None:
            return self.op(h)
        if h.dim() == 2:
            return torch.addmm(torch.zeros(self.weight.shape[1]), h, self.weight)  # GPT-2
        return (h @ self.weight).flatten(1)  # a 3-D input, folded by matmul


def linear_readers() -> nn.Sequential:
    """Every compressed save is read linearly into one weight's gradient or only through
    ReLU's exact decision, so each weight's gradient error is its block's rounding alone."""
    return nn.Sequential(
        _Reader(nn.Conv2d(3, 8, 3, stride=2, padding=1), first=True),
        _Reader(nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2), act=F.leaky_relu),
        _Reader(
            nn.Conv1d(8, 6, 5, padding="same"),
            shape=lambda h: (h.shape[0], 8, 64),
            act=lambda h: F.hardtanh(h, -0.5, 0.5),
        ),
        _Reader(nn.Linear(6 * 64, 48), shape=lambda h: (h.shape[0], -1)),
        _Reader(nn.Parameter(torch.randn(48, 24) / 7)),
        _Reader(nn.Parameter(torch.randn(6, 10) / 3), shape=lambda h: (h.shape[0], 4, 6)),
    )


def feature_readers() -> nn.Sequential:
    """Linear readers of a 3-D input, a 3-D ReLU output and a 2-D one (``addmm``), 256 rows
    each: at 2-3 bits their saves are grouped by feature (NOTE [Feature groups] in storing.py)."""
    return nn.Sequential(
        _Reader(nn.Linear(32, 48), first=True),
        _Reader(nn.Linear(48, 24)),
        _Reader(nn.Parameter(torch.randn(24, 10) / 5), shape=lambda h: (-1, 24)),
    )


@pytest.mark.parametrize(
    ("readers", "level", "widths"),
    [(linear_readers, "L1", [4, 6]), (feature_readers, "L1.2", [2])],
    ids=["convolutions and products, L1", "feature groups, L1.2"],
)
def test_measured_sensitivities_predict_the_rounding_variance_of_each_weight_gradient(
    readers: Callable[[], nn.Sequential], level: str, widths: list[int]
) -> None:
    """One measured step predicts ``E‖Δ grad W‖²`` of every weight, over 48 fresh rounding
    seeds, for linear, addmm, matmul and strided, dilated, grouped and 'same'-padded
    convolutions, and for saves grouped by feature at 2 bits. Tolerance: 4 standard errors of
    the empirical mean plus 8% of slack (with 100 seeds the first case's ratios were
    0.973-1.023, within 2.5 standard errors: BENCHMARKS.md); the false-alarm probability under
    the normal approximation is below 1e-4 per weight."""
    torch.manual_seed(0)
    model = readers()
    if readers is linear_readers:
        x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 40, (16,))
    else:
        x, y = torch.randn(8, 32, 32) * torch.logspace(-2, 0, 32), torch.randint(0, 10, (256,))
    weights = {name: p for name, p in model.named_parameters() if not name.endswith("bias")}
    exact = cross_entropy_grads(model, x, y, None)
    cfg = GactConfig.from_level(level, min_numel=0)
    controller, meter = measured_step(model, cfg, lambda: F.cross_entropy(model(x), y).backward())
    # the stored widths: the level's, and for the 8x8 maps of 1,024 elements per channel 2 more
    # (NOTE [Small maps] in norm_rules.py)
    stored = {key: r.bits for key, r in controller.ledger.view()[0].items()}
    assert sorted(set(stored[key] for key in meter.sensitivities())) == widths
    measured = meter.sensitivities()
    assert not meter.probed, meter.probed
    predicted = dict.fromkeys(weights, 0.0)
    for key, c in measured.items():  # a block's keys: "2#0:float32:4d" (ReLU), "2#1:..."
        (name,) = [n for n in weights if n.split(".")[0] == key.split(".")[0].split("#")[0]]
        predicted[name] += c * gact_policy.variance_factor(stored[key])
    assert all(v > 0 for v in predicted.values()), measured
    errors = {name: [] for name in weights}
    for seed in range(1, 49):
        g = cross_entropy_grads(model, x, y, cfg.replace(seed=seed))
        for name in weights:
            errors[name].append(float((g[name] - exact[name]).square().sum()))
    for name, values in errors.items():
        mean, se = np.mean(values), np.std(values, ddof=1) / math.sqrt(len(values))
        assert abs(mean - predicted[name]) <= 4 * se + 0.08 * predicted[name], (
            name,
            mean,
            predicted,
        )
    # biases read no saved activation: exact
    assert all(torch.equal(g_b, exact[n]) for n, g_b in g.items() if n.endswith("bias"))


def test_linear_uses_are_published_only_while_a_meter_runs() -> None:
    """Without a meter a linear layer costs ``DecisionMode`` nothing (no spec); with one, its
    input's save sees a ``LinearUse``, but a product of two activations does not."""
    layer, x = nn.Linear(4, 3), torch.randn(5, 4, requires_grad=True)
    seen = []

    class Spy(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self) -> None:
            super().__init__(lambda t: seen.append((t, current_spec())) or t, lambda t: t)

    with Spy(), DecisionMode():
        layer(x)
    assert seen and all(spec is None for _, spec in seen)
    meter = SensitivityMeter()
    meter.start()
    try:
        seen.clear()
        with Spy(), DecisionMode():
            layer(x)
            x @ torch.randn(4, 2, requires_grad=True).exp()  # not a leaf: an activation
        reads = [t for t, s in seen if s is not None and s.linear and s.linear.reads(t)]
        assert len(reads) == 1 and reads[0] is x  # not the weight, not the activation product
        seen.clear()
        with Spy(), DecisionMode():  # an op overload is matched by its name
            torch.ops.aten.linear.default(x, layer.weight)
        assert [t for t, s in seen if s is not None and s.linear and s.linear.reads(t)] == [x]
    finally:
        meter.stop()
    seen.clear()
    with Spy(), DecisionMode():
        layer(x)
    assert all(spec is None for _, spec in seen)


def _counted(case: str) -> tuple[nn.Module, Callable[[], torch.Tensor], list[int]]:
    """``case``'s model, its closure and the number of times the closure ran (a list of one)."""
    model, x, y = make_case(case)
    return (model, *_counting(model, x, y))


def _counting(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], list[int]]:
    """A closure training ``model`` on ``(x, y)`` and the number of times it ran."""
    calls = [0]
    closure = make_closure(model, x, y)

    def counted() -> torch.Tensor:
        calls[0] += 1
        return closure()

    return counted, calls


def _adapt_at_step_1(
    model: nn.Module, counted: Callable[[], torch.Tensor], calls: list[int]
) -> Controller:
    """Two iterate() steps at L2 adapting at step 1, with any probe affordable; ``calls``
    counts the second step's closure runs (the step's own and the probes')."""
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1, adapt_budget=None)
    with Controller(model, cfg) as controller:
        controller.iterate(counted)
        calls[0] = 0
        controller.iterate(counted)
    return controller


def test_measured_models_adapt_without_probes() -> None:
    """An MLP whose saves are all read linearly (or by ReLU's exact decision): its adaptations
    run no probe, iterate() runs the closure once per step, and the measured sensitivities
    reach the plan and the report."""
    model, counted, calls = _counted("mlp")
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=2, adapt_budget=None)
    with Controller(model, cfg) as controller:
        for _ in range(4):
            controller.iterate(counted)
    assert controller.adapter.count >= 1 and controller.adapter.last_probed == 0
    assert calls[0] == 4  # no probe ran
    assert controller.plan.sensitivity and all(
        math.isfinite(c) and c >= 0 for c in controller.plan.sensitivity.values()
    )
    assert set(controller.plan.stderr.values()) == {0.0}
    assert controller.plan.measured == set(controller.plan.bits)


def test_only_unmeasured_tensors_are_probed() -> None:
    """A transformer block: LayerNorm inputs and attention are probed, the linear layers' and
    the GELU's inputs measured; probes number ``min_pair_probes`` of the probed items."""
    model, counted, calls = _counted("transformer")
    controller = _adapt_at_step_1(model, counted, calls)
    adapter = controller.adapter
    assert adapter.count == 1
    items = len(controller.plan.bits)
    assert 0 < adapter.last_probed < items
    assert calls[0] == 1 + gact_policy.min_pair_probes(adapter.last_probed) + 1
    measured = controller.plan.measured
    assert any(k.startswith("qkv#") for k in measured)
    assert any(k.startswith("mlp.1#") for k in measured)  # NOTE [Measured pointwise inputs]
    assert not any(k.startswith("ln1#") for k in measured)
    assert len(measured) == items - adapter.last_probed


def test_few_probed_tensors_are_probed_each_alone() -> None:
    """One tensor needs a probe (a LayerNorm's input): the reference method estimates it with
    one run beside the base run, fewer than the pairwise method's minimum of 2, and the
    predicted cost of an adaptation counts those runs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 10))
    counted, calls = _counting(model, torch.randn(32, 64), torch.randint(0, 10, (32,)))
    adapter = _adapt_at_step_1(model, counted, calls).adapter
    assert adapter.count == 1 and adapter.last_probed == 1
    assert calls[0] == 1 + 2  # the step, the base run and one probe
    assert adapter.predicted_cost(1.0, probed=1) == 2.0
    assert adapter.predicted_cost(1.0, probed=4) == 5.0  # pairwise: min_pair_probes(4) + 1


def test_measure_linear_false_probes_every_tensor() -> None:
    model, x, y = make_case("mlp")
    cfg = GactConfig.from_level(
        "L2", min_numel=0, adapt_first_gap=1, adapt_budget=None, measure_linear=False
    )
    with Controller(model, cfg) as controller:
        for _ in range(2):
            controller.iterate(make_closure(model, x, y))
    assert controller.adapter.last_probed == len(controller.plan.bits) > 0


def test_step_loops_adapt_the_measured_tensors() -> None:
    """A loop that calls step() (no closure) adapts a measured model silently; a model with
    tensors that need probes adapts its measured tensors, keeps the others at their widths and
    warns that probing them needs iterate(closure); neither adapts again before the schedule's
    next adaptation."""
    for case, held in (("mlp", False), ("transformer", True)):
        model, x, y = make_case(case)
        cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=2, adapt_budget=None)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Controller(model, cfg) as controller:
                for step in range(6):
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    if step == 1:
                        prior = dict(controller.plan.bits)
                    controller.step()
        warned = [str(w.message) for w in caught if issubclass(w.category, GactWarning)]
        # at steps 2 and 4 of the schedule (gaps doubling from adapt_first_gap), not at every
        # step from 2 on: the loop cannot probe, so the schedule moves on after adapting
        assert controller.adapter.count == 2, case
        assert bool(warned) is held, (case, warned)
        plan = controller.plan
        unmeasured = set(plan.bits) - plan.measured
        assert bool(unmeasured) is held
        assert all(plan.bits[k] == prior[k] for k in unmeasured)
        assert all(k not in plan.sensitivity for k in unmeasured)
        assert decisions_idle()


def test_step_loops_that_iterate_on_due_steps_keep_the_probes_due() -> None:
    """A loop that calls iterate(closure) when ``adaptation_due`` says so and step() otherwise
    (what the warning recommends): a measuring step whose probes are unaffordable adapts its
    measured tensors in step(), silently, and the probing adaptation stays due for a later
    iterate()."""
    model, x, y = make_case("transformer")
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=2, adapt_budget=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GactWarning)  # the loop does what the warning asks
        controller = Controller(model, cfg)
        controller.install_hook()
        for _ in range(5):
            if controller.adaptation_due or controller.plan.step == 0:
                controller.iterate(make_closure(model, x, y))
            else:
                make_closure(model, x, y)()
                controller.step()
        controller.uninstall_hook()
    adapter = controller.adapter
    assert adapter.count == 1 and adapter.last_held > 0
    assert adapter.last_step is None  # still due: probes come once affordable


def decisions_idle() -> bool:
    """No meter is left running after the controller's steps ended."""

    return not linear_rules.measuring()


def test_a_controller_whose_hooks_are_off_measures_nothing() -> None:
    """A meter armed for the open step stops measuring when the hooks come off (the end of a
    ``with Controller`` block, ``paused()``) and measures again when they come back, whoever
    still holds the controller: ``linear_rules.measuring()`` is global, and while it is on every
    linear call in every model publishes its use. Before, it stayed on until the controller
    was garbage-collected."""
    model, x, y = make_case("cnn")
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1)
    controller = Controller(model, cfg)
    with controller:
        for _ in range(4):  # up to the first step the schedule measures
            make_closure(model, x, y)()
            if controller.hooks.meter is not None:
                break
            controller.step()
        assert controller.hooks.meter is not None and not decisions_idle()
        with controller.paused():
            assert decisions_idle()
        assert not decisions_idle()
    assert decisions_idle()  # the step stays open: the meter is still the controller's
    controller.install_hook()
    try:
        assert controller.hooks.meter is not None and not decisions_idle()
    finally:
        controller.uninstall_hook()


def test_padding_same_is_measured_as_its_explicit_padding() -> None:
    """The same convolution and rounding with ``padding='same'`` and ``padding=(1, 2)``
    measure the same sensitivity, and a border-free ``padding=0`` a smaller one."""
    values = []
    for padding in ("same", (1, 2), 0):
        torch.manual_seed(0)
        conv = nn.Conv2d(2, 3, (3, 5), padding=padding)
        x = torch.randn(4, 2, 8, 8)
        meter = SensitivityMeter()
        with Controller(conv, GactConfig.from_level("L1", min_numel=0)) as controller:
            controller.hooks.meter = meter
            meter.start()
            conv(x).square().sum().backward()
            meter.stop()
        (value,) = meter.sensitivities().values()
        values.append(value)
    assert values[0] == pytest.approx(values[1], rel=1e-6)
    assert 0 < values[2] < values[1]


def test_an_adaptation_waiting_for_the_budget_adapts_what_it_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first measured step tells that probes are needed and that the budget cannot pay
    for them: that step re-allocates the measured tensors' bits by their measurements (one
    made a million times larger here, so that they decide visibly), keeps
    the others at the prior's widths and runs no probe; the steps after it, still waiting for
    the probes, are not measured again (NOTE [Measuring steps])."""
    model, counted, calls = _counted("transformer")
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1, adapt_budget=1e-9)
    armed: list[bool] = []
    measure = SensitivityMeter.sensitivities

    def sharper(meter: SensitivityMeter) -> dict[str, float]:  # one tensor far more sensitive
        return {k: v * (1e6 if k.startswith("mlp.2") else 1) for k, v in measure(meter).items()}

    monkeypatch.setattr(SensitivityMeter, "sensitivities", sharper)
    with Controller(model, cfg) as controller:
        model.register_forward_hook(lambda *_: armed.append(controller.hooks.meter is not None))
        controller.iterate(counted)
        prior = dict(controller.plan.bits)
        for _ in range(5):
            controller.iterate(counted)
    assert armed == [False, True, False, False, False, False]
    assert calls[0] == 6  # no probe
    adapter, plan = controller.adapter, controller.plan
    assert adapter.count == 1 and adapter.last_probed == 0
    assert adapter.last_step is None  # the probing adaptation is still due
    assert plan.measured and plan.measured < set(plan.bits)
    held = set(plan.bits) - plan.measured
    assert all(plan.bits[k] == prior[k] for k in held)
    (sharp,) = [k for k in plan.measured if k.startswith("mlp.2")]
    assert plan.bits[sharp] > prior[sharp]  # the measurements decide the measured widths
    assert set(plan.sensitivity) == plan.measured
    assert controller.stats()["average_bits"] <= cfg.avg_bits + 1e-9


def test_measured_tensors_are_re_measured_on_schedule_while_probes_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [Measuring steps]: on a machine where training steps look slow and measuring
    looks cheap, the probes (whole steps each) never fit the 5% budget, but the measured
    tensors are measured and re-allocated again at every step of the schedule (1, 2, 4, 8,
    16), each time by their new sensitivities, the held ones keeping their widths. Before,
    their widths stayed those of step 1 until the probes ran: a linear input insensitive at
    initialisation (attention's queries) stayed at 1 bit for hundreds of steps."""
    model, counted, calls = _counted("transformer")
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1, adapt_budget=0.05)
    fake_clocks(monkeypatch, training=1.0, adapting=1e-6)
    measure = SensitivityMeter.sensitivities
    step = [0]

    def moving(meter: SensitivityMeter) -> dict[str, float]:  # one rises at step 8
        values = measure(meter).items()
        return {k: v * (1e6 if k.startswith("mlp.2") and step[0] >= 8 else 1) for k, v in values}

    monkeypatch.setattr(SensitivityMeter, "sensitivities", moving)
    armed, widths = [], []
    with Controller(model, cfg) as controller:
        model.register_forward_hook(lambda *_: armed.append(controller.hooks.meter is not None))
        controller.iterate(counted)
        prior = dict(controller.plan.bits)
        for step[0] in range(1, 20):
            controller.iterate(counted)
            widths.append(dict(controller.plan.bits))
    assert [s for s, on in enumerate(armed) if on] == [1, 2, 4, 8, 16]
    assert calls[0] == 20  # no probe
    adapter, plan = controller.adapter, controller.plan
    assert adapter.count == 5 and adapter.last_step is None  # the probes are still due
    held = set(plan.bits) - plan.measured
    assert held and all(w[k] == prior[k] for w in widths for k in held)
    (sharp,) = [k for k in plan.measured if k.startswith("mlp.2")]
    assert widths[7][sharp] > widths[3][sharp]  # re-allocated when its sensitivity rose


class _Unmeasurable(nn.Module):
    """Saves nothing a meter can measure: a tanh's output, and its square's input."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.bias).square().sum()


def test_a_run_that_never_adapted_does_not_measure_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [Measuring steps]: a measuring step that finds nothing to measure and cannot
    afford its probes adapts nothing; measuring again waits for the probes, not for a
    schedule counted from an adaptation that never happened (which made every later step a
    measuring one)."""
    model, x = _Unmeasurable(), torch.randn(32, 64)
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1, adapt_budget=0.05)
    fake_clocks(monkeypatch, training=1.0, adapting=1e-6)

    def closure() -> torch.Tensor:
        model.zero_grad()
        loss = model(x)
        loss.backward()
        return loss

    armed = []
    with Controller(model, cfg) as controller:
        model.register_forward_hook(lambda *_: armed.append(controller.hooks.meter is not None))
        for _ in range(20):
            controller.iterate(closure)
    assert [s for s, on in enumerate(armed) if on] == [1]
    assert controller.adapter.count == 0


def test_two_valued_tensors_need_no_probe() -> None:
    """A dropout's mask, saved as floats, is stored exactly at its pinned 1 bit: an MLP with
    dropout has nothing to probe, so its first measured step adapts fully (the schedule moves
    on) even when no probe would be affordable."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1, adapt_budget=1e-9)
    with Controller(model, cfg) as controller:
        for _ in range(3):
            controller.iterate(make_closure(model, x, y))
    assert controller.plan.two_valued and any(controller.plan.two_valued.values())
    assert controller.adapter.count == 1 and controller.adapter.last_step == 1
    assert controller.plan.measured == set(controller.plan.bits)


def test_tensors_kept_at_full_precision_are_still_measured() -> None:
    """A budget large enough for full precision keeps the tensors as they are; later
    adaptations measure them through a throwaway 8-bit quantization, so none needs probes,
    including a ReLU output that the next linear layer also reads (one shared save)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    counted, calls = _counting(model, torch.randn(32, 64), torch.randint(0, 10, (32,)))
    cfg = GactConfig.from_level(
        "L2", min_numel=0, adapt_first_gap=1, adapt_budget=None, memory_budget=1 << 30
    )
    widths = []
    with Controller(model, cfg) as controller:
        for _ in range(5):
            controller.iterate(counted)
            widths.append(sorted(controller.plan.bits.values()))
    plan = controller.plan
    assert controller.adapter.count >= 2 and calls[0] == 5  # no probe
    assert set(plan.bits) == {"0#0:float32:2d", "1#0:float32:2d"}
    # every allocation keeps both at full precision: a ReLU output measured as if only ReLU
    # read it (sensitivity 0) would drop to 1 bit
    assert widths == [[32, 32]] * 5
    assert plan.measured == set(plan.bits)
    assert all(c > 0 for c in plan.sensitivity.values())


class _ProducerThenNorm(nn.Module):
    """``producer`` -> BatchNorm -> ReLU -> a linear head; ``residual``: the BatchNorm reads
    the producer's output plus its input instead (no measured producer)."""

    def __init__(self, producer: nn.Module, norm: nn.Module, head: int, residual=False) -> None:
        super().__init__()
        self.producer, self.norm, self.residual = producer, norm, residual
        self.head = nn.Linear(head, 10)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.producer(x)
        return self.head(F.relu(self.norm(h + x if self.residual else h)).flatten(1))


def _normalised(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A model of ``kind`` and its input: a 4-level grid ({0, 1/3, 2/3, 1}, exact at 2 and 4
    bits), so that only the BatchNorm input's rounding reaches the gradient of the producer's
    weight and of the BatchNorm's."""
    torch.manual_seed(0)
    if kind == "conv2d":
        model = _ProducerThenNorm(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), 16 * 64)
        shape = (32, 3, 8, 8)
    elif kind == "grouped conv1d":
        model = _ProducerThenNorm(
            nn.Conv1d(4, 8, 5, padding=2, groups=2), nn.BatchNorm1d(8), 8 * 48
        )
        shape = (32, 4, 48)
    else:
        model = _ProducerThenNorm(nn.Linear(32, 24), nn.BatchNorm1d(24), 24)
        shape = (256, 32)
    return model, torch.randint(0, 4, shape).float() / 3


@pytest.mark.parametrize("level", ["L1", "L1.2"])
@pytest.mark.parametrize("kind", ["conv2d", "grouped conv1d", "linear"])
def test_measured_batchnorm_inputs_predict_their_rounding_variance(kind: str, level: str) -> None:
    """NOTE [Measured BatchNorm inputs]: the measured sensitivity of a BatchNorm's input that a
    convolution or linear layer produced predicts ``E‖Δ grad‖²`` of the BatchNorm's weight and
    the producer's, over 32 rounding seeds. The measurement leaves out a cross term and
    second-order terms (with 64 seeds it was 0.95-1.03 of the truth on these six cases):
    tolerance 4 standard errors of the empirical mean plus 15% of slack (false-alarm
    probability under the normal approximation below 1e-4). Without the elementwise term
    (``spread``) a linear case measured 0.39 of the truth."""
    model, x = _normalised(kind)
    y = torch.randint(0, 10, (x.shape[0],))
    cfg = GactConfig.from_level(level, min_numel=100)  # the statistics (1-D) stay exact
    controller, meter = measured_step(model, cfg, lambda: F.cross_entropy(model(x), y).backward())
    stored = {key: r.bits for key, r in controller.ledger.view()[0].items()}
    measured = meter.sensitivities()
    assert not meter.probed, meter.probed
    assert measured["producer#0:" + next(iter(stored)).split(":", 1)[1]] == 0.0  # on the grid
    (key,) = [k for k in measured if k.startswith("norm#0")]
    predicted = measured[key] * gact_policy.variance_factor(stored[key])
    mean, se = rounding_errors(model, x, y, cfg, ("producer.weight", "norm.weight"))
    assert abs(mean - predicted) <= 4 * se + 0.15 * predicted, (mean, se, predicted)


def test_batchnorm_inputs_no_measured_layer_produced_are_probed() -> None:
    """A BatchNorm reading a residual sum (its error travels back along paths the meter does
    not follow) leaves its input to the probes."""
    _, x = _normalised("conv2d")
    model = _ProducerThenNorm(
        nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), 3 * 64, residual=True
    )
    y = torch.randint(0, 10, (x.shape[0],))
    cfg = GactConfig.from_level("L1", min_numel=100)
    _, meter = measured_step(model, cfg, lambda: F.cross_entropy(model(x), y).backward())
    assert [k.split("#")[0] for k in meter.probed] == ["norm"]
    assert "norm" not in {k.split("#")[0] for k in meter.sensitivities()}


def test_a_max_pooled_relu_output_needs_no_probe() -> None:
    """The ResNet stem's pattern (conv, BatchNorm, ReLU, max pooling, conv): every save is
    measured, and the pooled ReLU output, stored as its decisions (NOTE [Decision-only saves]
    in saved.py), is no item to measure, so an adaptation runs no probe."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 64, 10),
    )  # fmt: skip
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    controller, meter = measured_step(
        model,
        GactConfig.from_level("L2", min_numel=100),
        lambda: F.cross_entropy(model(x), y).backward(),
    )
    measured = meter.sensitivities()
    assert not meter.probed, meter.probed
    kinds = {k: r.kind for k, r in controller.ledger.view()[0].items()}
    pooled = [k for k in kinds if k.startswith("2#")]  # the in-place ReLU's output
    assert pooled and all(kinds[k] is Kind.DECISIONS and k not in measured for k in pooled)
    assert any(k.startswith("1#") and measured[k] > 0 for k in measured)  # the BatchNorm input


def test_measuring_adaptations_of_a_fully_measured_model_keep_to_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [Measuring steps]: a model with nothing to probe (an MLP) still pays for its
    measurements. With a measurement that looks half as long as a training step, the first
    measuring adaptation is always made; after it, none lifts the time spent adapting above
    5% of the training time. Before, a measuring adaptation was predicted to cost nothing: it
    ran whenever the time already spent was within the budget, and its own cost then took the
    overhead to 9%."""
    model, counted, calls = _counted("mlp")
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1, adapt_budget=0.05)
    fake_clocks(monkeypatch, training=1.0, adapting=0.05)
    after = []  # the overhead after each adaptation but the first
    with Controller(model, cfg) as controller:
        for _ in range(60):
            count = controller.adapter.count
            controller.iterate(counted)
            if 1 <= count < controller.adapter.count:
                after.append(controller.stats()["adaptation_overhead"])
    assert calls[0] == 60  # no probe
    assert len(after) >= 2 and max(after) <= 0.05, after


def test_batchnorm_inputs_are_measured_under_autocast() -> None:
    """A measuring step of a CNN under bf16 autocast: the meter's own products (the producer's
    ``H``, the window norms) run in fp32, outside autocast; under it they came out in bf16 and
    the backward's term failed on a dot of an fp32 and a bf16 vector."""
    model, x = _normalised("conv2d")
    y = torch.randint(0, 10, (x.shape[0],))

    def backward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()

    _, meter = measured_step(model, GactConfig.from_level("L1", min_numel=100), backward)
    measured = meter.sensitivities()
    assert not meter.probed, meter.probed
    (key,) = [k for k in measured if k.startswith("norm#0")]
    assert math.isfinite(measured[key]) and measured[key] > 0


def test_a_closure_that_fails_on_a_measuring_step_leaves_no_measurement_behind() -> None:
    """A closure that raises after its forward (a loss check) on a measuring step, retried on
    the same batch with the buffers and RNG restored, is the same step: the adaptation must
    find the same sensitivities and bits as a run without the failure. The failed forward's
    meter stayed attached, its measurements unfinished: the retry's adaptation measured
    nothing (every item probed; a BatchNorm input's sensitivity 0.08 became 596)."""

    def run(fail: bool) -> tuple[dict[str, float], dict[str, int]]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64),
            nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 10),
        )  # fmt: skip
        config = GactConfig.from_level(
            "L2", adapt_first_gap=0, adapt_interval=2, adapt_budget=None, min_numel=0
        )
        controller = Controller(model, config)
        x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
        failed = [not fail]

        def closure() -> torch.Tensor:
            loss = F.cross_entropy(model(x), y)
            if not failed[0]:
                failed[0] = True
                raise FloatingPointError("loss check")
            model.zero_grad()
            loss.backward()
            return loss

        with controller:
            buffers, rng = [b.clone() for b in model.buffers()], torch.get_rng_state()
            try:
                controller.iterate(closure)
            except FloatingPointError:
                with torch.no_grad():
                    for b, v in zip(model.buffers(), buffers):
                        b.copy_(v)
                torch.set_rng_state(rng)
                controller.iterate(closure)
        assert controller.stats()["adaptations"] == 1
        return dict(controller.plan.sensitivity), dict(controller.plan.bits)

    assert run(fail=True) == run(fail=False)
