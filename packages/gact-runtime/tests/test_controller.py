"""The public API: the seed README's usage, the idiomatic forms, and every error path."""

from __future__ import annotations

import threading
import weakref

import gact
import gact_policy
import pytest
import torch
import torch.nn.functional as F
from gact import ClosureError, Controller, GactConfig, GactWarning, HookStateError
from gact.controller import Controller as SeedController
from gact.ledger import Kind
from models import MLP, make_case
from runtime_helpers import make_closure
from torch import nn


def test_seed_readme_usage_trains() -> None:
    model, x, y = make_case("mlp")
    gact.set_optimization_level("L2")
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        controller = SeedController(model)
        controller.install_hook()
        losses = []
        for _ in range(30):

            def backprop() -> None:
                model.train()
                output = model(x)
                loss = F.cross_entropy(output, y)
                optimizer.zero_grad()
                loss.backward()
                losses.append(loss.item())

            controller.iterate(backprop)
            optimizer.step()
        controller.uninstall_hook()
    finally:
        gact.set_optimization_level("L2")
    assert losses[-1] < 0.5 * losses[0]
    assert controller.stats()["ratio"] > 1.0
    # every save is measured (linear inputs, ReLU's decision, the dropout's two-valued mask):
    # the schedule's first adaptation (step 10) needs no probe
    assert controller.stats()["adaptations"] >= 1 and controller.adapter.last_probed == 0
    assert controller.plan.measured == set(controller.plan.bits)


def test_context_manager_and_plain_loop_at_fixed_level() -> None:
    model, x, y = make_case("cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    controller = Controller(model, GactConfig.from_level("L1", min_numel=0))
    with controller:
        assert controller.installed
        for _ in range(3):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            controller.step()
    assert not controller.installed
    st = controller.stats()
    assert st["step"] == 3 and st["compressed_tensors"] > 0
    assert st["average_bits"] == 4
    # Outside the context nothing is hooked any more.
    before = controller.ledger.current.copy()
    F.cross_entropy(model(x), y).backward()
    assert controller.ledger.current == before


def test_iterate_returns_the_closure_result() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1")) as controller:
        out = controller.iterate(make_closure(model, x, y))
    assert isinstance(out, torch.Tensor) and out.ndim == 0


@pytest.mark.parametrize("between", ["clip_grad_norm_", "another model's backward"])
def test_iterate_runs_every_closure_whatever_ran_between_steps(between: str) -> None:
    """``loss = controller.iterate(closure)``, then gradient clipping or a plain PyTorch update of
    another model (a GAN's discriminator) before the next step: neither is this step's backward
    (NOTE [Backwards seen] in backwards.py), so every closure runs and training matches PyTorch's
    bit for bit at L0. Clipping rescales the gradients in place after the boundary, and the other
    model's saves are unpacked by its own backward: each was taken for a backward of the open step,
    the closure was skipped on 29 of 30 steps, and the optimizer re-applied the last clipped
    gradient (final loss 1.45 against 0.96)."""

    def train(gact: bool) -> tuple[int, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        other = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        batches = [(torch.randn(64, 8), torch.randn(64, 8)) for _ in range(6)]
        controller = SeedController(model, GactConfig.from_level("L0")) if gact else None
        ran = 0
        if controller is not None:
            controller.install_hook()
        for x, y in batches:

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                loss = (model(x) - y).square().mean()
                optimizer.zero_grad()
                loss.backward()
                return loss

            loss = closure() if controller is None else controller.iterate(closure)
            ran += loss is not None
            if between == "clip_grad_norm_":
                nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            if between != "clip_grad_norm_":  # the discriminator's update, as PyTorch's
                real, fake = other(torch.randn(64, 8)), other(model(x).detach())
                other.zero_grad()
                (F.softplus(-real).mean() + F.softplus(fake).mean()).backward()
        if controller is not None:
            controller.uninstall_hook()
        return ran, [p.detach() for p in model.parameters()]

    plain_ran, plain = train(False)
    ran, params = train(True)
    assert ran == plain_ran == 6
    assert all(torch.equal(p, q) for p, q in zip(plain, params))


def test_stats_and_report() -> None:
    model, x, y = make_case("cnn")
    with Controller(model, GactConfig.from_level("L1.2", min_numel=0)) as controller:
        controller.iterate(make_closure(model, x, y))
    st = controller.stats()
    for key in ("original_bytes", "stored_bytes", "ratio", "compressed_tensors", "skipped_tensors"):
        assert key in st
    assert st["ratio"] == pytest.approx(st["original_bytes"] / st["stored_bytes"])
    assert st["ratio"] > 5
    report = controller.report()
    assert "conv1#0" in report and "quantized" in report and "bits" in report.splitlines()[0]


def test_level_zero_measures_without_compressing() -> None:
    model, x, y = make_case("cnn")
    with Controller(model, GactConfig.from_level("L0")) as controller:
        controller.iterate(make_closure(model, x, y))
    st = controller.stats()
    assert st["original_bytes"] > 0 and st["stored_bytes"] == st["original_bytes"]
    assert st["compressed_tensors"] == 0


def test_state_errors() -> None:
    model, x, y = make_case("mlp")
    controller = Controller(model, GactConfig.from_level("L1"))
    with pytest.raises(HookStateError, match="before install_hook"):
        controller.iterate(make_closure(model, x, y))
    with pytest.raises(HookStateError, match="not installed"):
        controller.uninstall_hook()
    controller.install_hook()
    with pytest.raises(HookStateError, match="twice"):
        controller.install_hook()
    controller.uninstall_hook()
    assert not controller.installed


def test_uninstall_refuses_to_pop_someone_elses_hooks() -> None:
    model, _, _ = make_case("mlp")
    controller = Controller(model)
    controller.install_hook()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(HookStateError, match="exit it before"):
            controller.uninstall_hook()
    controller.uninstall_hook()


def test_bad_constructor_arguments() -> None:
    class NoParams(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match="no parameters"):
        Controller(NoParams())
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        Controller(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GactConfig"):
        Controller(MLP(), "L2")  # type: ignore[arg-type]


def test_closure_without_backward_is_an_error_and_controller_stays_usable() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L2", min_numel=0)) as controller:

        def no_backward() -> None:
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y)

        with pytest.raises(ClosureError, match=r"loss\.backward"):
            controller.iterate(no_backward)
        controller.iterate(make_closure(model, x, y))
        with pytest.raises(ClosureError):  # gradients set to None are no backward either
            controller.iterate(no_backward)
        controller.iterate(make_closure(model, x, y))
        assert controller.stats()["compressed_tensors"] > 0
    with pytest.raises(TypeError, match="callable"):
        controller.run_closure(42)  # type: ignore[arg-type]


def test_iterate_holds_no_gradient_of_the_last_step() -> None:
    """``iterate`` checks that the closure ran a backward without keeping last step's gradients
    alive: ``zero_grad()`` frees them as it would without GACT (on the H200, a held copy of
    ResNet-18's 45 MiB of gradients made GACT's step peak 1.6x fp32's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 64)
    freed = []

    def closure() -> torch.Tensor:
        loss = model(x).square().mean()
        old = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        freed.append(bool(old) and all(ref() is None for ref in old))
        loss.backward()
        return loss

    closure()
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        for _ in range(2):
            controller.iterate(closure)
        with pytest.raises(ClosureError):  # the check still tells a closure without backward
            controller.iterate(lambda: model(x).sum())
    assert freed == [False, True, True]  # the first call had no gradients yet


def test_exception_in_closure_leaves_controller_consistent() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L2", min_numel=0)) as controller:

        def boom() -> None:
            model(x)
            raise RuntimeError("user bug")

        with pytest.raises(RuntimeError, match="user bug"):
            controller.iterate(boom)
        assert controller.installed and not controller.ledger.current
        controller.iterate(make_closure(model, x, y))
    assert controller.stats()["step"] == 1


def test_exception_inside_a_module_does_not_corrupt_scopes() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            if self.fail:
                raise RuntimeError("inner")
            return h

    model = Fails()
    x = torch.randn(2, 4, requires_grad=True)
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        with pytest.raises(RuntimeError, match="inner"):
            model(x)
        model.fail = False
        model(x).sum().backward()
    assert len(controller.tracker._stack()) == 1


def test_level_change_mid_step_is_refused() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        loss = F.cross_entropy(model(x), y)
        with pytest.raises(HookStateError, match="middle of a step"):
            controller.configure("L1.2")
        assert controller.config.level == "L1"
        loss.backward()
        controller.step()
        controller.configure("L1.2")
        controller.iterate(make_closure(model, x, y))
    assert controller.stats()["average_bits"] == 2
    with pytest.raises(ValueError, match="unknown optimization level"):
        controller.configure("L5")


# ------------------------------------------------------------- several controllers, threads


def _weights_of(model: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def test_each_controller_compresses_its_own_models_saves() -> None:
    a, xa, ya = make_case("mlp")
    b, xb, yb = make_case("cnn")
    ctl_a = Controller(a, GactConfig.from_level("L1", min_numel=0))
    ctl_b = Controller(b, GactConfig.from_level("L1.1", min_numel=0))
    with ctl_a, ctl_b:  # only B's hooks are the innermost pair: B's pack sees every save
        make_closure(a, xa, ya)()
        make_closure(b, xb, yb)()
        ctl_a.step()
        ctl_b.step()
    keys_a, keys_b = set(ctl_a.ledger.last), set(ctl_b.ledger.last)
    assert ctl_a.stats()["compressed_tensors"] > 0 and ctl_b.stats()["compressed_tensors"] > 0
    assert {k.split("#")[0] for k in keys_a} <= {"fc1", "fc2", "drop", "<root>", "<parameters>",
                                                  "<outside>"}  # fmt: skip
    assert not any(k.startswith(("fc1", "fc2")) for k in keys_b)
    assert ctl_a.stats()["average_bits"] == 4 and ctl_b.stats()["average_bits"] == 8


def test_nested_models_each_keep_their_own_saves() -> None:
    inner = MLP()
    outer = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), inner)
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
    with Controller(outer, GactConfig.from_level("L1", min_numel=0)) as ctl_outer:
        with Controller(inner, GactConfig.from_level("L1.2", min_numel=0)) as ctl_inner:
            make_closure(outer, x, y)()
            ctl_inner.step()
        ctl_outer.step()
    inner_keys = {k.split("#")[0] for k in ctl_inner.ledger.last}
    outer_keys = {k.split("#")[0] for k in ctl_outer.ledger.last}
    assert {"fc1", "fc2"} <= inner_keys and not {"2.fc1", "2.fc2"} & outer_keys
    assert "0" in outer_keys and ctl_inner.stats()["average_bits"] == 2


def test_saves_outside_the_models_forward_are_kept() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        logits = model(x)
        loss = F.cross_entropy(logits * 2, y)  # outside the model's forward
        loss.backward()
        controller.step()
    outside = [r for r in controller.ledger.last.values() if r.key.startswith("<outside>")]
    assert outside and all(r.kind is Kind.OUTSIDE for r in outside)
    assert controller.stats()["outside_tensors"] == sum(r.count for r in outside)


def test_training_on_another_thread_warns_once() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1")) as controller:

        def train() -> None:
            for _ in range(2):
                make_closure(model, x, y)()

        with pytest.warns(GactWarning, match="thread-local") as record:
            worker = threading.Thread(target=train)
            worker.start()
            worker.join()
    assert len([w for w in record if issubclass(w.category, GactWarning)]) == 1
    assert not controller.ledger.current and controller.ledger.last is None  # nothing compressed


def test_two_controllers_on_one_model_are_refused() -> None:
    model, _, _ = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1")):
        with pytest.raises(HookStateError, match="already installed on this model"):
            Controller(model).install_hook()


# ------------------------------------------------------------- steps (NOTE [Steps])


def test_step_before_install_is_an_error() -> None:
    model, _, _ = make_case("mlp")
    with pytest.raises(HookStateError, match="before install_hook"):
        Controller(model).step()


def test_adaptive_level_in_a_plain_loop_warns_that_probed_tensors_keep_their_widths() -> None:
    """A model with tensors that need probes (LayerNorm, attention), adapting from step 0 (the
    original GACT's schedule): its measured tensors adapt, the others keep their widths, and
    a warning says why (test_measured.py has the same with a later first adaptation)."""
    model, x, y = make_case("transformer")
    with Controller(
        model, GactConfig.from_level("L2", min_numel=0, adapt_first_gap=0)
    ) as controller:
        with pytest.warns(GactWarning, match=r"probes sensitivities only in iterate\(closure\)"):
            for _ in range(2):
                make_closure(model, x, y)()
                controller.step()
    assert controller.stats()["adaptations"] >= 1
    assert controller.adapter.last_held > 0 and controller.adapter.last_probed == 0


def test_iterate_then_step_counts_one_step() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1")) as controller:
        with pytest.warns(GactWarning, match="count every batch twice"):
            for _ in range(3):
                controller.iterate(make_closure(model, x, y))
                controller.step()
    assert controller.stats()["step"] == 3


def test_without_step_calls_stats_describe_one_step() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1")) as controller:
        make_closure(model, x, y)()
        one_step = controller.ledger.current and controller.stats()["original_bytes"]
        for _ in range(4):
            make_closure(model, x, y)()
        make_closure(model, x, y)()  # its step is still open: stats show the one before
    assert controller.stats()["original_bytes"] == one_step
    assert controller.stats()["step"] == 5


@pytest.mark.parametrize("level", ["L1", "L2"])
def test_original_gact_loop_runs_each_forward_once(level: str) -> None:
    """The original's benchmarks run forward, backward and optimizer.step() themselves, then
    call iterate(backprop): the closure runs only for probes when an adaptation is due."""
    model, x, y = make_case("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def backprop() -> None:
        calls.append(1)
        make_closure(model, x, y)()

    for measure in (True, False):  # the MLP's tensors are all measured: no probe at all
        calls.clear()
        cfg = GactConfig.from_level(level, min_numel=0, adapt_first_gap=0, measure_linear=measure)
        with Controller(model, cfg) as controller:
            for _ in range(3):
                make_closure(model, x, y)()
                optimizer.step()
                assert controller.iterate(backprop) is None
        probes = len(controller.plan.bits) if level == "L2" and not measure else 0
        probes = probes and 1 + gact_policy.min_pair_probes(probes)
        assert len(calls) >= probes and (len(calls) == 0) == (level == "L1" or measure)
        assert controller.stats()["step"] == 3
        assert controller.stats()["adaptations"] == (1 if level == "L2" else 0)


def test_torch_func_runs_while_the_controller_is_paused() -> None:
    model, x, _ = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as controller:
        loss = model(x).sum()  # saved while installed: compressed
        with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
            torch.func.grad(lambda t: model(t).sum())(x)
        with controller.paused():
            grad = torch.func.grad(lambda t: model(t).sum())(x)
        assert controller.installed
        loss.backward()
        controller.step()
    assert grad.shape == x.shape and controller.stats()["compressed_tensors"] > 0


def test_explicit_steps_never_end_a_step_automatically() -> None:
    model, x, y = make_case("mlp")
    with Controller(model, GactConfig.from_level("L1"), explicit_steps=True) as controller:
        for _ in range(3):  # three micro-batches of one accumulated step
            make_closure(model, x, y)()
        assert controller.stats()["step"] == 0
        controller.step()
    assert controller.stats()["step"] == 1
    with pytest.raises(TypeError, match="explicit_steps"):
        Controller(model, explicit_steps="yes")  # type: ignore[arg-type]


def test_a_copy_of_the_model_made_while_installed_is_not_controlled() -> None:
    """``copy.deepcopy(model)`` while a controller is installed (an EMA or teacher copy) copies
    the model's hooks too: the copy's forward raised a KeyError, and its root hook ran the
    original's (a forward of the copy would have ended the original's step). The copy now
    trains as a plain model, also after uninstall, and the original's step is its own."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    controller = SeedController(model, GactConfig.from_level("L1", min_numel=0))
    with controller:
        loss = model(x).sum()
        ema = copy.deepcopy(model)
        ema(x).sum().backward()  # the copy's saves are not GACT's
        loss.backward()
        recorded = controller.ledger.recorded
        controller.step()
    assert controller.stats()["step"] == 1 and recorded == controller.ledger.recorded
    plain = copy.deepcopy(ema)
    plain.zero_grad()
    ema.zero_grad()
    ema(x).sum().backward()  # after uninstall
    plain(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ema.parameters(), plain.parameters()))


@pytest.mark.parametrize("compiled", [False, True])
def test_the_model_saves_and_loads_while_installed(compiled: bool) -> None:
    """``torch.save(model)`` in the middle of training (a checkpoint of the whole module):
    GACT's hooks on the model's modules were local functions, which pickle cannot save, so it
    raised. The loaded model carries hooks that do nothing (as a deep copy does), computes as
    the original, and trains under a controller of its own. The original trains on."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    run = torch.compile(model, backend="aot_eager") if compiled else model
    controller = SeedController(run, GactConfig.from_level("L1", min_numel=0))
    x = torch.randn(8, 16)
    with controller:
        run(x).sum().backward()
        controller.step()
        buffer = io.BytesIO()
        torch.save(run, buffer)
        run(x).sum().backward()
        controller.step()
    assert controller.stats()["compressed_tensors"] > 0
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), run(x), rtol=0, atol=0)  # same weights
    copy_controller = SeedController(loaded, GactConfig.from_level("L1", min_numel=0))
    with copy_controller:
        loaded(x).sum().backward()
        copy_controller.step()
    assert copy_controller.stats()["compressed_tensors"] > 0


def test_a_failed_install_leaves_no_hook_on_the_parameters() -> None:
    """``install_hook()`` under ``disable_saved_tensors_hooks`` raises; the gradient-counting
    hooks it registers on the parameters (NOTE [Backwards seen] in backwards.py) must not stay
    behind."""
    model = nn.Linear(4, 4)
    controller = SeedController(model, GactConfig.from_level("L1"))
    for _ in range(2):
        with pytest.raises(RuntimeError):
            with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
                controller.install_hook()
    assert not controller.installed
    assert not model.weight._post_accumulate_grad_hooks
    with controller:
        assert len(model.weight._post_accumulate_grad_hooks) == 1
    assert not model.weight._post_accumulate_grad_hooks


def test_two_controlled_models_each_count_their_own_backwards() -> None:
    """A GAN with both models controlled: the innermost hooks pair (the generator's) unpacks
    the discriminator's saves in the discriminator's own backward. Those unpacks were counted
    as the generator's, so its ``iterate`` took its step's backward as done and skipped the
    closure on every step (NOTE [Backwards seen] in backwards.py)."""
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    discriminator = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    config = GactConfig.from_level("L1", min_numel=0)
    d_controller = SeedController(discriminator, config)
    g_controller = SeedController(generator, config)
    d_controller.install_hook()
    g_controller.install_hook()  # the innermost pair
    try:
        for _ in range(3):
            discriminator.zero_grad()
            discriminator(torch.randn(32, 64)).square().mean().backward()
            d_controller.step()

            def closure() -> torch.Tensor:
                generator.zero_grad()
                loss = -discriminator(generator(torch.randn(32, 64))).mean()
                loss.backward()
                return loss

            assert g_controller.iterate(closure) is not None
    finally:
        g_controller.uninstall_hook()
        d_controller.uninstall_hook()
    assert d_controller.hooks.unpacked_inside > 0 and g_controller.hooks.unpacked_inside > 0


def test_gradients_rescaled_before_the_first_step_do_not_skip_it() -> None:
    """The first step's mark is taken when the hooks are installed, as the counting hooks see
    the gradients: gradients from a warm-up without GACT, rescaled in place (clipping, or
    ``zero_grad(set_to_none=False)``) before the first ``iterate``, made it skip the closure."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(32, 8)
    controller = SeedController(model, GactConfig.from_level("L1", min_numel=0))
    model(x).sum().backward()  # a warm-up step without GACT
    with controller:
        model.zero_grad(set_to_none=False)

        def closure() -> torch.Tensor:
            loss = model(x).sum()
            loss.backward()
            return loss

        assert controller.iterate(closure) is not None
