"""Adaptive precision: probes leave no trace, and sensitive tensors get more bits."""

from __future__ import annotations

import warnings

import gact
import gact_kernels
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gact import ConfigError, Controller, GactConfig, GactWarning
from gact.adapt import Adapter, Items, preference_tiers
from gact.hooks import SaveHooks
from gact.ledger import Kind
from gact.plan import BitPlan
from gact.saved import SavedCompressed
from models import make_case
from runtime_helpers import fake_clocks, grads_of, make_closure, record_saves
from torch import nn


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_probes_leave_no_trace() -> None:
    """After an adapting step, RNG, buffers, modes and gradients are those of the real step."""
    model, x, y = make_case("cnn")
    model.bn1.momentum = 0.3
    initial = _state(model)

    def closure() -> None:  # draws from the RNG inside, like dropout would
        model.train()
        noise = torch.randn_like(x) * 0.01
        loss = F.cross_entropy(model(x + noise), y)
        model.zero_grad()
        loss.backward()

    cfg = GactConfig.from_level("L2", min_numel=0, adapt_interval=1000, adapt_first_gap=0)
    # Reference: the real step alone (same seeds: a fresh controller at step 0).
    torch.manual_seed(7)
    with Controller(model, cfg) as controller:
        controller.run_closure(closure)
    expected_rng, expected_state, expected_grads = (
        torch.get_rng_state(),
        _state(model),
        grads_of(model),
    )

    model.load_state_dict(initial)
    model.zero_grad(set_to_none=True)
    model.eval()  # the closure switches to train mode; the probes must not leave it changed
    torch.manual_seed(7)
    with Controller(model, cfg) as controller:
        controller.iterate(closure)
    assert controller.stats()["adaptations"] == 1
    assert torch.equal(torch.get_rng_state(), expected_rng)
    for k, v in _state(model).items():
        assert torch.equal(v, expected_state[k]), k
    for g, e in zip(grads_of(model), expected_grads):
        assert torch.equal(g, e)
    assert model.bn1.momentum == 0.3
    assert model.training  # what the real closure left, not what the probes did


def test_probe_steps_are_not_counted_in_stats() -> None:
    model, x, y = make_case("mlp")
    closure = make_closure(model, x, y)
    with Controller(
        model, GactConfig.from_level("L2", min_numel=0, adapt_first_gap=0)
    ) as controller:
        controller.iterate(closure)
        first = controller.stats()
        controller.iterate(closure)
        second = controller.stats()
    # the first step ran 1 + K probe closures on top of the real one; none of them is counted
    assert first["original_bytes"] == second["original_bytes"]
    kinds = ("compressed_tensors", "skipped_tensors", "outside_tensors")
    saves = [sum(first[k] for k in kinds), sum(second[k] for k in kinds)]
    assert (
        saves[0]
        == saves[1]
        == sum(r.count for r in controller.ledger.last.values() if r.kind is not Kind.PARAMETER)
    )


class TwoPaths(nn.Module):
    """One activation feeds the loss through a large weight, the other through a tiny one."""

    def __init__(self) -> None:
        super().__init__()
        self.loud = nn.Linear(256, 256)
        self.quiet = nn.Linear(256, 256)
        self.head = nn.Linear(256, 4)
        with torch.no_grad():
            self.quiet.weight.mul_(1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.loud(x))
        b = torch.tanh(self.quiet(x))
        return self.head(a + 1e-3 * b)


def test_sensitive_tensors_get_more_bits_within_budget() -> None:
    torch.manual_seed(0)
    model = TwoPaths()
    x, y = torch.randn(256, 256), torch.randint(0, 4, (256,))
    for method in ("pairwise", "probe"):
        cfg = GactConfig.from_level(
            "L2", min_numel=0, sensitivity_method=method, num_probes=8, adapt_first_gap=0
        )
        with Controller(model, cfg) as controller:
            controller.iterate(make_closure(model, x, y))
            controller.iterate(make_closure(model, x, y))
        bits, sens = controller.plan.bits, controller.plan.sensitivity
        a_key, b_key = "<root>#0:float32:2d", "<root>#1:float32:2d"  # tanh outputs a and b
        assert sens[a_key] > 100 * sens[b_key], (method, sens)
        assert bits[a_key] > bits[b_key], (method, bits)
        records = controller.ledger.last
        numel = {k: records[k].numel for k in bits}
        used = sum(n * (bits[k] + 0.25 if bits[k] <= 8 else bits[k]) for k, n in numel.items())
        assert used <= 4.0 * sum(numel.values())


def test_probes_on_a_sub_batch_still_measure_small_tensors() -> None:
    model, x, y = make_case("mlp")  # batch 32: activations of 32 x 128 = 4096 elements
    cfg = GactConfig.from_level("L2", min_numel=2048, adapt_first_gap=0)
    with Controller(model, cfg) as controller:
        controller.iterate(
            make_closure(model, x, y), probe_closure=make_closure(model, x[:4], y[:4])
        )
    sens = controller.plan.sensitivity
    # On the 4-row sub-batch these inputs have 256 and 512 elements, under min_numel; probes
    # still quantize them, so their estimates are real rather than a spurious zero.
    assert sens["fc1#0:float32:2d"] > 0 and sens["fc2#0:float32:2d"] > 0, sens


def test_probes_store_each_key_at_the_width_they_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe on a sub-batch stores every key it names at the width it sets, even where the
    sub-batch's maps are small (NOTE [Small maps] in norm_rules.py: 8 images of 8x8 hold 512
    elements per channel, the training batch's 32 hold 2,048): the widths' lower bounds come
    from the training step's saves, and a floor taken from the sub-batch would make the
    estimator read a key's noise at one width as another's. The tanh's output on those maps is
    probed (its backward reads it through ``1 - y^2``; the BatchNorm's input is measured)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 64, 10),
    )  # fmt: skip
    x, y = torch.randn(32, 3, 8, 8), torch.randint(0, 10, (32,))
    stored: list[tuple[int, int]] = []  # (width stored, width the probe set) per probed save
    compress = SaveHooks._compress

    def spy(self, key, tensor, compact, spec, **kwargs):  # type: ignore[no-untyped-def]
        saved = compress(self, key, tensor, compact, spec, **kwargs)
        known = getattr(saved, "known", None)
        if self.plan.probes(key) and isinstance(known, gact_kernels.QuantizedTensor):
            zero_exact = spec is not None and spec.zero_exact
            stored.append((known.bits, max(self.plan.bits_for(key), 2 if zero_exact else 1)))
        return saved

    monkeypatch.setattr(SaveHooks, "_compress", spy)
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=0)
    with Controller(model, cfg) as controller:
        controller.iterate(
            make_closure(model, x, y), probe_closure=make_closure(model, x[:8], y[:8])
        )
    assert controller.stats()["adaptations"] >= 1
    assert stored and all(b == want for b, want in stored), stored


@pytest.mark.parametrize("level", ["L2", "L2.2"])
def test_adaptive_levels_keep_their_average_where_small_map_floors_do_not_fit(level: str) -> None:
    """NOTE [Small maps] in norm_rules.py: a CNN whose every map is small (64 x 4 x 4 = 1,024
    elements per channel) cannot store every save 2 bits (its BatchNorm's input 4) above the
    level's width within its average. The floors yield to the budget: the level's average holds (codes and metadata) and
    nothing warns, as long as the hard lower bounds (2 bits for ReLU outputs) fit."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
    )
    x = torch.randn(64, 8, 4, 4)
    cfg = GactConfig.from_level(level, min_numel=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GactWarning)
        with Controller(model, cfg) as controller:
            for _ in range(3):
                model(x).square().mean().backward()
                controller.step()
    records = [r for r in controller.ledger.last.values() if r.kind is Kind.QUANTIZED]
    assert len(records) == 3  # the input, the BatchNorm's input, the ReLU's output
    nominal = {"L2": 4, "L2.2": 2}[level]  # the BatchNorm's input 4 above it, the others 2
    assert sorted(r.preferred_bits for r in records) == [nominal + 2, nominal + 2, nominal + 4]
    used = sum(r.numel * (r.bits + r.metadata_bits) for r in records)
    assert used <= cfg.avg_bits * sum(r.numel for r in records)


def test_preferred_widths_yield_to_the_budget_a_bit_at_a_time() -> None:
    """NOTE [Preference tiers] in adapt.py: two equally sensitive items of 1,024 elements at L2
    (4 bits per element on average, 0.25 of them metadata), preferring 8 and 4 bits. Lowered by
    0, 1 or 2 bits the preferences do not fit; by 3 (5 and 1 bits) they do, and the rest of the
    budget goes to the second item. Yielding all at once, the allocation would start from 1 bit
    each and give the first 4."""
    plan = BitPlan(GactConfig.from_level("L2"))
    items = Items(
        keys=["a", "b"],
        numel=np.array([1024, 1024]),
        full_bits=np.array([32, 32]),
        overhead_bits=np.array([0.25, 0.25]),
        lower=np.array([1, 1]),
        pinned=np.array([0, 0]),
        preferred=np.array([8, 4]),
        fixed_bytes=0,
    )
    bits = Adapter(nn.Identity(), plan, hooks=None)._allocate(items, np.ones(2))  # type: ignore[arg-type]
    assert bits.tolist() == [5, 2]
    assert [t.tolist() for t in preference_tiers(items.preferred, items.lower)] == [
        [8, 4], [7, 3], [6, 2], [5, 1], [4, 1], [3, 1], [2, 1], [1, 1]
    ]  # fmt: skip


def _cnn_with_probes() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The CNN case with a tanh on its logits, whose output needs probes (the CNN's saves are
    all measured, its BatchNorms' statistics kept)."""
    model, x, y = make_case("cnn")
    return nn.Sequential(model, nn.Tanh()), x, y


def test_a_failing_adaptation_still_closes_the_step() -> None:
    model, x, y = _cnn_with_probes()
    calls = {"n": 0}
    closure = make_closure(model, x, y)

    def flaky() -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:  # the first probe
            raise RuntimeError("probe failed")
        return closure()

    with Controller(
        model, GactConfig.from_level("L2", min_numel=0, adapt_first_gap=0)
    ) as controller:
        try:
            controller.iterate(flaky)
        except RuntimeError as e:
            assert "probe failed" in str(e)
        else:
            raise AssertionError("the probe's exception was swallowed")
        assert controller.stats()["step"] == 1 and not controller.ledger.current
        controller.iterate(closure)
    assert controller.stats()["step"] == 2


# ------------------------------------------------------------- byte budget


@pytest.mark.parametrize("fraction", [0.15, 0.2, 0.3])
def test_memory_budget_bounds_the_stored_bytes(fraction: float) -> None:
    model, x, y = make_case("cnn")
    closure = make_closure(model, x, y)
    with Controller(model, GactConfig.from_level("L0")) as controller:
        controller.iterate(closure)
    full = controller.stats()["original_bytes"]
    budget = int(fraction * full)
    cfg = GactConfig.from_level("L2", min_numel=0, memory_budget=budget)
    with Controller(model, cfg) as controller:
        for _ in range(2):  # the first step adapts, the second stores with the new widths
            controller.iterate(closure)
    st = controller.stats()
    assert st["memory_budget"] == budget
    assert budget * 0.9 <= st["stored_bytes"] <= budget


def test_a_budget_too_small_for_one_bit_warns_and_uses_the_smallest_widths() -> None:
    model, x, y = make_case("cnn")
    closure = make_closure(model, x, y)
    with Controller(model, GactConfig.from_level("L2", min_numel=0, memory_budget=1)) as ctl:
        with pytest.warns(GactWarning, match="cannot hold"):
            ctl.iterate(closure)
        ctl.iterate(closure)
    records = ctl.ledger.last
    smallest = {k: 2 if records[k].zero_exact else 1 for k in ctl.plan.bits}  # 2: ReLU outputs
    assert ctl.plan.bits == smallest and set(smallest.values()) == {1, 2}


def test_memory_budget_needs_an_adaptive_level() -> None:
    with pytest.raises(ConfigError, match="memory_budget needs an adaptive level"):
        GactConfig.from_level("L1", memory_budget=10**6)
    with pytest.raises(ConfigError, match="memory_budget must be"):
        GactConfig.from_level("L2", memory_budget=1.5)
    assert gact.set_optimization_level("L2", memory_budget=2**20).memory_budget == 2**20
    gact.set_optimization_level("L2", memory_budget=None)


# ------------------------------------------------------------- schedule


def _train(
    cfg: GactConfig, steps: int, probe_fraction: float = 1.0
) -> tuple[list[int], dict[str, int], torch.Tensor]:
    """The MLP case trained ``steps`` SGD steps through ``iterate``: the steps at which it
    adapted, its final bits and its first layer's weights."""
    torch.manual_seed(0)
    model, x, y = make_case("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    closure = make_closure(model, x, y)
    seen = []
    with Controller(model, cfg) as controller:
        for step in range(steps):
            before = controller.adapter.count
            controller.iterate(closure, probe_fraction=probe_fraction)
            opt.step()
            if controller.adapter.count > before:
                seen.append(step)
    return seen, dict(controller.plan.bits), next(model.parameters()).detach().clone()


def _adapted_steps(cfg: GactConfig, steps: int, probe_fraction: float = 1.0) -> list[int]:
    """Steps at which an MLP adapted; its tensors are probed (``measure_linear=False``: every
    one of them could be measured, test_measured.py)."""
    return _train(cfg.replace(measure_linear=False), steps, probe_fraction)[0]


def test_adaptations_follow_the_schedule_when_affordable() -> None:
    cfg = GactConfig.from_level(
        "L2", min_numel=0, adapt_interval=40, adapt_first_gap=5, adapt_budget=None
    )
    assert _adapted_steps(cfg, 90) == [5, 10, 20, 40, 80]  # step 0: the prior allocation


def test_the_time_budget_delays_adaptations() -> None:
    assert _adapted_steps(GactConfig.from_level("L2", min_numel=0, adapt_budget=0.0), 30) == []
    original = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=0, adapt_budget=0.0)
    assert _adapted_steps(original, 30) == [0]  # the original schedule probes at step 0
    # probes cost about a step each: a 5% budget cannot afford a second adaptation in 30 steps
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1, adapt_budget=0.05)
    assert _adapted_steps(cfg, 30) == []


def _run_on_clocks(
    cfg: GactConfig, monkeypatch: pytest.MonkeyPatch, step_tick: float, adapt_tick: float
) -> tuple[list[int], dict[str, int], torch.Tensor]:
    """``_train`` for 30 steps with the controller's clock advancing ``step_tick`` and the
    adapter's and meter's ``adapt_tick`` per reading: a machine on which training, or adapting,
    looks slow."""
    fake_clocks(monkeypatch, training=step_tick, adapting=adapt_tick)
    return _train(cfg, 30)


def test_without_a_time_budget_runs_do_not_depend_on_the_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [Adaptation schedule] in gact_policy: with the default budget, a machine on which
    adapting looks slow adapts at fewer steps than one on which training does (where the
    sensitivities move, with other bits then); with ``adapt_budget=None`` both runs adapt at the
    same steps to the same bits and train the same weights, bit for bit."""
    timed = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1)
    fast, slow = (
        _run_on_clocks(timed, monkeypatch, *ticks) for ticks in ((1.0, 1e-6), (1e-6, 1.0))
    )
    # the first adaptation is predicted from the training steps' time; the next ones from the
    # last adaptation's, which the slow clock makes unaffordable
    assert fast[0] == [1, 2, 4, 8, 16] and slow[0] == [1]
    free = timed.replace(adapt_budget=None)
    a, b = (_run_on_clocks(free, monkeypatch, *ticks) for ticks in ((1.0, 1e-6), (1e-6, 1.0)))
    assert a[0] == b[0] == [1, 2, 4, 8, 16] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_deterministic_torch_is_warned_about_the_time_budget() -> None:
    model = make_case("mlp")[0]
    torch.use_deterministic_algorithms(True)
    try:
        timed = Controller(model, GactConfig.from_level("L2"))
        with pytest.warns(GactWarning, match="adapt_budget=None for a reproducible run"):
            timed.install_hook()
        timed.uninstall_hook()
        with warnings.catch_warnings():
            warnings.simplefilter("error", GactWarning)
            controller = Controller(model, GactConfig.from_level("L2", adapt_budget=None))
            controller.install_hook()
            controller.uninstall_hook()
    finally:
        torch.use_deterministic_algorithms(False)


def test_cheaper_probes_are_afforded_sooner() -> None:
    """``probe_fraction``: probes on a small share of the batch make the first adaptation's
    predicted cost small enough for the 5% budget (the schedule of the test above, whose full
    probes were never afforded); later adaptations are charged what they measured."""
    cfg = GactConfig.from_level("L2", min_numel=0, adapt_first_gap=1, adapt_budget=0.05)
    assert _adapted_steps(cfg, 30, probe_fraction=1e-4)[:1] == [1]
    model, x, y = make_case("mlp")
    with Controller(model, cfg) as controller:
        for bad in (0.0, -0.5, 1.5):
            with pytest.raises(ValueError, match="probe_fraction must be in"):
                controller.iterate(make_closure(model, x, y), probe_fraction=bad)
        controller.iterate(make_closure(model, x, y))  # still usable


@pytest.mark.parametrize("case", ["cnn", "transformer"])
def test_report_shows_estimates_with_their_uncertainty(case: str) -> None:
    model, x, y = _cnn_with_probes() if case == "cnn" else make_case(case)
    with Controller(
        model, GactConfig.from_level("L2", min_numel=0, adapt_first_gap=0)
    ) as controller:
        controller.iterate(make_closure(model, x, y))
    report = controller.report()
    quantized = [line for line in report.splitlines() if " quantized " in line]
    measured = [line for line in quantized if line.split()[5:7][1:] == ["m"]]
    probed = [line for line in quantized if line not in measured]
    assert probed and measured, report
    if case == "cnn":
        # the inputs of convolutions, of the linear layer and of the BatchNorms a convolution
        # produced are measured, the pooled ReLU output at 0; the tanh's output (one item,
        # probed alone by the reference method: no standard error) is probed; the BatchNorms'
        # statistics are kept
        assert [line.split()[0] for line in probed] == ["1#0:float32:2d"]
        measured_in = {line.split("#")[0] for line in measured}
        assert {"0.conv1", "0.bn1", "0.bn2", "0.fc"} <= measured_in
        kept = [line for line in report.splitlines() if line.split()[3:4] == ["kept"]]
        assert {line.split("#")[0] for line in kept} == {"0.bn1", "0.bn2"}
        # the ReLU outputs are on the zero-exact grid (no mask needed)
        assert any(line.split()[4].endswith("z") for line in quantized)
    else:  # LayerNorm inputs, attention, GELU inputs: probed pairwise, with a standard error
        assert all("±" in line for line in probed), report
        assert any(line.startswith("ln1#") for line in probed)
        assert any(line.startswith("qkv#") for line in measured)
    assert "sensitivity: the gradient variance" in report.splitlines()[-1]


def test_the_first_step_allocates_without_probes() -> None:
    """NOTE [Prior allocation]: equal sensitivities, so the small tensors get the wider codes."""
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 8), nn.Tanh(),
                          nn.Linear(8, 4))  # fmt: skip
    x, y = torch.randn(256, 256), torch.randint(0, 4, (256,))
    runs = []
    closure = make_closure(model, x, y)
    with Controller(model, GactConfig.from_level("L2", min_numel=0)) as controller:
        controller.iterate(lambda: runs.append(1) or closure())
    assert runs == [1] and controller.stats()["adaptations"] == 0
    bits = controller.plan.bits
    small, large = "3#0:float32:2d", "1#0:float32:2d"  # tanh outputs of 256 x 8 and 256 x 512
    assert bits[small] > bits[large]
    numel = {k: controller.ledger.last[k].numel for k in bits}
    used = sum(n * (bits[k] + 0.25) for k, n in numel.items())
    assert used <= 4.0 * sum(numel.values())


@pytest.mark.parametrize("sensitivity_method", ["prior", "pairwise"])
def test_relu_outputs_get_at_least_2_bits_within_the_budget(sensitivity_method: str) -> None:
    """A ReLU output is stored on the zero-exact grid from 2 bits on, without a mask; 1 bit
    would need a mask and cost as much as 2 zero-exact bits, so the allocator's lower width for
    it is 2, and what the step stores stays within L2.2's 2 bits per element."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.Tanh(),
                          nn.Linear(512, 4))  # fmt: skip
    x, y = torch.randn(256, 256), torch.randint(0, 4, (256,))
    closure = make_closure(model, x, y)
    gap = 100 if sensitivity_method == "prior" else 1
    cfg = GactConfig.from_level("L2.2", min_numel=0, adapt_first_gap=gap, adapt_budget=None)
    with Controller(model, cfg) as controller:
        for _ in range(2):  # pairwise: the second step probes, then stores with new widths
            controller.iterate(closure)
    assert controller.stats()["adaptations"] == (0 if sensitivity_method == "prior" else 1)
    records = controller.ledger.last
    relu = [k for k, r in records.items() if r.zero_exact]
    assert relu == ["1#0:float32:2d"]
    assert controller.plan.bits[relu[0]] >= 2 and records[relu[0]].mask_bytes == 0
    quantized = [r for r in records.values() if r.kind is Kind.QUANTIZED]
    stored = sum(r.stored_bytes for r in quantized)
    assert stored <= 2.0 * sum(r.numel for r in quantized) / 8 + 16 * len(quantized)


def test_a_level_below_the_smallest_widths_warns_and_uses_them() -> None:
    """L2.2 averages 2 bits with metadata; a model that saves only ReLU outputs needs 2.25
    (2 zero-exact bits, or 1 bit and a mask). On main the first allocation raised
    ``InfeasibleBudgetError`` out of ``iterate``; it now warns once and uses the smallest
    widths."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 4))  # fmt: skip
    x, y = torch.randn(128, 64, requires_grad=True), torch.randint(0, 4, (128,))
    closure = make_closure(model, x, y)
    with Controller(model, GactConfig.from_level("L2.2", adapt_first_gap=100)) as controller:
        with pytest.warns(GactWarning, match="level L2.2 averages 2.0 bits per element"):
            controller.iterate(closure)
        controller.iterate(closure)
    relu = {k for k, r in controller.ledger.last.items() if r.zero_exact}
    assert len(relu) == 2 and all(controller.plan.bits[k] == 2 for k in relu)


def test_two_valued_tensors_get_1_exact_bit_and_free_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Binary features (Cora's bag of words, one-hot inputs) take two values: 1 bit stores them
    exactly, so the first allocation pins them there and spends the bits saved on the other
    tensors (NOTE [Two-valued tensors] in adapt.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4))
    x = (torch.rand(256, 512) < 0.05).float()  # binary features, saved by the first layer
    y = torch.randint(0, 4, (256,))
    key = "0#0:float32:2d"
    bits = []
    for features in (x + 0.5 * torch.rand_like(x), x):  # not two-valued, then two-valued
        controller = Controller(model, GactConfig.from_level("L2", min_numel=0))
        saved = record_saves(controller, monkeypatch)
        closure = make_closure(model, features, y)
        with controller:
            controller.iterate(closure)  # the first step allocates (prior)
            controller.iterate(closure)  # the second stores with that allocation
        bits.append(dict(controller.plan.bits))
    assert bits[0][key] > 1 and bits[1][key] == 1
    assert all(bits[1][k] > bits[0][k] for k in bits[1] if k != key)
    stored = [s for s in saved if isinstance(s, SavedCompressed) and s.key == key][-1]
    assert stored.payload.bits == 1 and torch.equal(gact_kernels.decompress(stored.payload), x)
    # the report says why the tensor has 1 bit: it is stored exactly ("1e"), not rounded
    row = next(line.split() for line in controller.report().splitlines() if line.startswith(key))
    assert row[4] == "1e"
    others = [line.split() for line in controller.report().splitlines()[2:] if "#" in line]
    assert all(r[4] != "1e" for r in others if r[0] != key)
    assert "e: exact" in controller.report()


@pytest.mark.parametrize("level, bits", [("L2", 4), ("L2.1", 3), ("L2.2", 2)])
def test_the_first_step_stores_at_the_average_rounded_up(level: str, bits: int) -> None:
    """Before the first allocation, an adaptive level stores every tensor at its average net of
    metadata rounded up (NOTE [Prior allocation]): rounded down, L2.2's first step stored
    everything at 1 bit, and its gradient came out 10^2-10^6 times fp32's on the model matrix's
    transformers (BENCHMARKS.md, "Stability")."""
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level(level)) as controller:
        make_closure(model, x, y)()
        widths = {r.bits for r in controller.ledger.current.values() if r.kind is Kind.QUANTIZED}
    assert widths == {bits}


def test_a_new_budget_is_allocated_at_the_next_step_boundary() -> None:
    """``configure`` with another adaptive budget (a ``memory_budget``, or L2 -> L2.2) cleared
    the widths, and no allocation followed until the next scheduled adaptation: every save
    took the level's default width, 2.4x the new budget's bytes for 18 steps. Now the step
    after the change is allocated at its end, as a run's first step is (NOTE [Prior
    allocation]), from the sensitivities already known."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256), nn.LayerNorm(256),
        nn.Tanh(), nn.Linear(256, 10),
    )  # fmt: skip
    x, y = torch.randn(128, 32), torch.randint(0, 10, (128,))
    controller = Controller(model, GactConfig.from_level("L2", adapt_budget=None))

    def closure() -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        return loss

    budget = 40_000
    with controller:
        for step in range(14):  # adaptations at steps 0 (prior) and 10 (default schedule)
            if step == 11:
                controller.configure(controller.config.replace(memory_budget=budget))
            controller.iterate(closure)
    assert controller.stats()["adaptations"] == 1  # none scheduled after the change
    assert controller.stats()["stored_bytes"] <= budget


class _Alternating(nn.Module):
    """A block that runs on odd steps only (multi-task style), between two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(32, 128), nn.Linear(128, 10)
        self.extra = nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU())

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        return self.l2(self.extra(h) if extra else h)


def test_keys_an_adapting_step_did_not_save_keep_their_widths() -> None:
    """NOTE [Keys the step did not save]: an adaptation on a step that did not run a block
    placed its own step's tensors alone, and the block's tensors lost the widths and
    sensitivities the previous adaptation had given them (back to the level's default)."""
    torch.manual_seed(0)
    model = _Alternating()
    config = GactConfig.from_level(
        "L2", adapt_first_gap=1, adapt_interval=1, adapt_budget=None, memory_budget=40_000
    )
    controller = Controller(model, config)
    x, y = torch.randn(128, 32), torch.randint(0, 10, (128,))
    widths = []
    with controller:
        for step in range(4):  # adaptations at steps 1, 2, 3; the block runs on odd steps

            def closure(extra: bool = step % 2 == 1) -> torch.Tensor:
                loss = F.cross_entropy(model(x, extra), y)
                model.zero_grad()
                loss.backward()
                return loss

            controller.iterate(closure)
            widths.append(dict(controller.plan.bits))
    block = [k for k in widths[1] if k.startswith("extra.")]
    assert block and controller.stats()["adaptations"] == 3
    assert {k: widths[2][k] for k in block} == {k: widths[1][k] for k in block}  # step 2: absent
    assert all(k in controller.plan.sensitivity for k in block)
