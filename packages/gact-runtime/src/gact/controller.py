"""The ``Controller``: installs GACT's hooks on a model and drives adaptation."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from . import compiled, resume
from .adapt import Adapter, rank_zeros
from .backwards import BackwardsSeen
from .compiled_sites import CompiledSite
from .config import GactConfig, get_config
from .errors import ClosureError, GactWarning, HookStateError
from .hooks import SaveHooks, installed_hooks
from .ledger import Ledger
from .measured import SensitivityMeter
from .measured_compiled import measure_eagerly
from .pacing import Pacing
from .params import ParameterFilter
from .plan import BitPlan, mix_seed
from .probes import trained_leaves
from .scope import ScopeTracker
from .swap import Swapper

__all__ = ["Controller"]

T = TypeVar("T")
_INSTALLED: weakref.WeakSet[Controller] = weakref.WeakSet()

# NOTE [Steps]
# A *step* is one optimizer step: everything between two step boundaries. Several forwards in one
# step (gradient accumulation) are accounted together; ``stats()`` and ``report()`` describe the
# last completed step. Boundaries come from one of three sources:
# - ``iterate(closure)`` ends the step it runs. If the open step already ran a backward (NOTE
#   [Backwards seen] in backwards.py; the original GACT's loop: the user's own forward,
#   backward and ``optimizer.step()``, then ``iterate(backprop)``), the closure is not run
#   again: ``iterate`` only ends the step, running the closure for probes when an adaptation
#   is due.
# - ``step()``, called by a plain loop after ``optimizer.step()``, like an LR scheduler. A
#   ``step()`` right after ``iterate()`` with nothing saved in between is ignored (with a warning):
#   it would count one batch as two steps.
# - Neither: until the first ``step()`` or ``iterate()``, a root forward that starts after a
#   backward ends the open step automatically, so ``stats()`` never sums up a whole run.
# Adaptive levels re-estimate sensitivities on the steps their schedule makes due (NOTE
# [Adaptation schedule] in gact_policy: step 0, doubling early steps, every ``adapt_interval``,
# within ``adapt_budget`` of the training time). That needs a closure to run probes, so only
# ``iterate`` adapts; a plain loop at an adaptive level keeps the level's default width and is
# warned once.


def _top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost saved-tensor hooks pair, or ``None`` where torch cannot tell (< 2.4)."""
    getter = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if getter is None else getter(False)


class Controller:
    """Compresses the activations that autograd saves while ``model`` trains.

    Args:
        model: the model to train. Its parameters and buffers are never compressed.
        config: a ``GactConfig``; ``None`` takes the default set by
            ``gact.set_optimization_level``.
        explicit_steps: the caller ends every step with ``step()`` or ``iterate()`` (a
            training framework's callback): no automatic steps, even before the first call
            (NOTE [Steps]). Gradient accumulation then never splits the first step.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> from gact import Controller, GactConfig
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
        ...                             torch.nn.Linear(64, 4))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
        >>> controller = Controller(model, GactConfig.from_level("L2", min_numel=0))
        >>> with controller:
        ...     for _ in range(3):
        ...         def closure():
        ...             loss = F.cross_entropy(model(x), y)
        ...             optimizer.zero_grad()
        ...             loss.backward()
        ...             return loss
        ...         loss = controller.iterate(closure)
        ...         optimizer.step()
        >>> controller.stats()["ratio"] > 1
        True
    """

    def __init__(
        self, model: nn.Module, config: GactConfig | None = None, *, explicit_steps: bool = False
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if config is not None and not isinstance(config, GactConfig):
            raise TypeError(
                f"config must be a gact.GactConfig or None, got {type(config).__name__}; "
                "build one with GactConfig.from_level('L2', ...)"
            )
        if next(model.parameters(), None) is None:
            raise ValueError(
                "model has no parameters: there is nothing to train, so GACT has nothing to do"
            )
        # Controller(torch.compile(model)): track the compiled module's original, entering its
        # scope around the compiled module's calls (NOTE [Compiled forwards] in scope.py)
        compiled_module = None
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            compiled_module, model = model, model._orig_mod
        self.model = model
        self.plan = BitPlan(config if config is not None else get_config())
        self.ledger = Ledger()
        self.parameter_filter = ParameterFilter(model)
        self.tracker = ScopeTracker(
            model,
            on_root_forward=self._on_root_forward,
            on_compiled_return=self._on_compiled_return,
            compiled_module=compiled_module,
        )
        self.hooks = SaveHooks(
            self.plan, self.tracker, self.parameter_filter, self.ledger, self._make_swapper()
        )
        self.hooks.on_compiled = self._on_compiled
        self.hooks.on_unknown_use = self._on_unknown_use
        self.adapter = Adapter(model, self.plan, self.hooks)
        self.pacing = Pacing(self.plan, self.adapter, self.hooks, self.ledger)
        self._context: torch.autograd.graph.saved_tensors_hooks | None = None
        self._thread: int | None = None
        self._ever_installed = False
        if not isinstance(explicit_steps, bool):
            raise TypeError(f"explicit_steps must be a bool, got {explicit_steps!r}")
        self._explicit_steps = explicit_steps  # no automatic steps (NOTE [Steps])
        self._iterated = False  # iterate() ran: probes can come (NOTE [Held tensors] in adapt.py)
        self._last_boundary = "none"
        self._unpacked_at_forward = 0
        self._recorded_at_forward = 0
        self.backwards = BackwardsSeen(model, self.hooks)  # NOTE [Backwards seen] in backwards.py
        self._step_started = time.perf_counter()
        self._warned: set[str] = set()

    # ----------------------------------------------------------------- configuration
    @property
    def config(self) -> GactConfig:
        return self.plan.config

    def configure(self, config: GactConfig | str) -> None:
        """Change the configuration (or just the level) between steps.

        Raises:
            HookStateError: if the open step already saved tensors (a level change mid-step).
        """
        if isinstance(config, str):
            config = self.config.replace(level=config)
        elif not isinstance(config, GactConfig):
            raise TypeError(f"config must be a GactConfig or a level name, got {config!r}")
        if self.ledger.current:
            raise HookStateError(
                "cannot change the configuration in the middle of a step (tensors were saved "
                "since the last step boundary); call controller.step() first"
            )
        self.plan.config = config
        self.plan.bits.clear()
        self.adapter.has_prior = False  # the next step's end allocates the new budget
        self.hooks.swapper = self._make_swapper()

    def _make_swapper(self) -> Swapper | None:
        return Swapper() if self.config.spec.swap else None

    def _warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            warnings.warn(message, GactWarning, stacklevel=3)

    # ----------------------------------------------------------------- hooks
    @property
    def installed(self) -> bool:
        return self._context is not None

    def install_hook(self) -> None:
        """Start compressing: push GACT's saved-tensor hooks on this thread (like torch's hooks,
        they are thread-local: install on the thread that runs forward and backward).

        Raises:
            HookStateError: if already installed, or another installed controller has this model.
        """
        if self._context is not None:
            raise HookStateError("install_hook() was called twice; call uninstall_hook() first")
        for other in _INSTALLED:
            if other.model is self.model:
                raise HookStateError(
                    "another Controller is already installed on this model; uninstall it "
                    "first (one model, one controller; nested models may have one each)"
                )
        cfg = self.config
        deterministic = torch.are_deterministic_algorithms_enabled()
        if deterministic and cfg.spec.adaptive and cfg.adapt_budget is not None:
            self._warn_once(  # NOTE [Adaptation schedule] in gact_policy
                "reproducible",
                f"torch.use_deterministic_algorithms is on, but level {cfg.level} decides when "
                f"to adapt by reading the clock (adapt_budget={cfg.adapt_budget}), so its bits, "
                "and the gradients, vary from run to run; pass adapt_budget=None for a "
                "reproducible run (every scheduled adaptation then runs)",
            )
        self.parameter_filter.refresh()
        runner = self.tracker.compiled_module  # given, or seen trained through since
        if runner is None and getattr(self.model, "_compiled_call_impl", None) is not None:
            runner = self.model  # model.compile()
        self.tracker.attach(compiled=runner)  # see NOTE [Compiled forwards] in scope.py
        context = torch.autograd.graph.saved_tensors_hooks(*self.hooks.modules)
        context.__enter__()
        compiled.CompileSettings.enter()
        self._context = context
        self.backwards.attach()
        if not self.ledger.current:  # the open step's mark, as the counting hooks see it
            self.backwards.boundary = self.backwards.mark()
        self._thread = threading.get_ident()
        self._ever_installed = True
        installed_hooks().append(self.hooks)
        _INSTALLED.add(self)
        self.hooks.compile_clock.start()
        if self.hooks.meter is not None:  # the open step's meter measures while hooks are on
            self.hooks.meter.start()

    def uninstall_hook(self) -> None:
        """Stop compressing. Tensors saved so far stay compressed and still unpack correctly."""
        if self._context is None:
            raise HookStateError("uninstall_hook() called but the hooks are not installed")
        if threading.get_ident() != self._thread:
            raise HookStateError(
                "uninstall_hook() must run on the thread that called install_hook() "
                "(saved-tensor hooks are thread-local)"
            )
        top = _top_saved_tensors_hooks()
        if top is not None and top[0] is not self.hooks.modules[0]:
            raise HookStateError(
                "another saved_tensors_hooks context was entered after install_hook() and is "
                "still active; exit it before uninstall_hook()"
            )
        self._context.__exit__(None, None, None)
        compiled.CompileSettings.exit()
        self._context = None
        installed_hooks().remove(self.hooks)
        _INSTALLED.discard(self)
        self.tracker.detach()
        self.backwards.detach()
        self.hooks.compile_clock.stop()
        if self.hooks.meter is not None:  # measuring is global: other models would publish
            self.hooks.meter.stop()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Uninstall the hooks for the body of a ``with`` block, then install them again.

        For code that refuses saved-tensor hooks (``torch.func.grad``, ``vjp``, ``jacrev``,
        ``hessian``) in the middle of training. Tensors saved before stay compressed.

        Example::

            >>> import torch
            >>> from gact import Controller, GactConfig
            >>> model = torch.nn.Linear(8, 1)
            >>> with Controller(model, GactConfig.from_level("L1")) as controller:
            ...     with controller.paused():
            ...         grad = torch.func.grad(lambda x: model(x).sum())(torch.randn(8))
            >>> grad.shape
            torch.Size([8])
        """
        self.uninstall_hook()
        try:
            yield
        finally:
            self.install_hook()

    def __enter__(self) -> Controller:
        self.install_hook()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall_hook()

    def _on_root_forward(self) -> None:
        self.parameter_filter.refresh()  # follows model.to(...)
        self.hooks.forward_started()
        if self.installed:
            self.hooks.compile_clock.start()  # again after torch._dynamo.reset()
        if (
            self.installed
            and torch.is_grad_enabled()
            and self.hooks not in installed_hooks()
            and not self.hooks.probing
        ):
            self._warn_once(
                "thread",
                "the model's forward runs on a thread where this Controller's hooks are not "
                "installed, so nothing it saves is compressed; saved-tensor hooks are "
                "thread-local: call install_hook() (or enter `with controller:`) on the thread "
                "that trains",
            )
        if (
            not self._explicit_steps
            and not self.hooks.probing  # a probe's forward never ends the user's step
            and self.ledger.current
            and self.hooks.unpacked_inside > self._unpacked_at_forward
        ):
            self._end_step("auto")
        self._unpacked_at_forward = self.hooks.unpacked_inside
        self._recorded_at_forward = self.ledger.recorded
        self.pacing.arm()

    def _on_compiled_return(self, output: object) -> None:
        # A compiled forward that builds an autograd graph saves tensors; if none reached
        # GACT's hooks, AOTAutograd handed none over (NOTE [Compiled saves] in compiled.py:
        # with its default filtering, a model compiled layer by layer saves only graph inputs
        # and outputs). Every activation is then stored uncompressed: never silently. A level
        # that compresses nothing (L0) stores them so by design, and so does a graph whose
        # traced saves are all kept (each below ``min_numel``): it calls no hook as it runs.
        hooks = self.hooks
        if (
            self.config.spec.compresses
            and torch.is_grad_enabled()
            and not hooks.probing
            and self.ledger.recorded == self._recorded_at_forward
            and hooks.compiled_graphs <= hooks.compressing_graphs
            and any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in torch.utils._pytree.tree_leaves(output)
            )
        ):
            mode = getattr(torch._functorch.config, "saved_tensors_hooks_filtering_mode", None)
            self._warn_once(
                "compile-bypass",
                "the model's compiled forward saved tensors for the backward without calling "
                "GACT's hooks: nothing is compressed. AOTAutograd hands saved tensors to hooks "
                "as torch._functorch.config.saved_tensors_hooks_filtering_mode says (here "
                f"{mode!r}; GACT sets 'no_static', everything but parameters, unless another "
                "mode was chosen), and the default 'donated' hands over no input or output of "
                "a graph, all that a model compiled layer by layer saves. Use 'no_static', "
                "remove the graph breaks (torch._dynamo.explain(model)(x) lists them), or "
                "train this model uncompiled under GACT",
            )

    def _on_compiled(self) -> None:
        if not self.hooks.compiled_sites:
            self._warn_once(
                "compile",
                "the model's forward is compiled (torch.compile) and saved tensors eagerly, and "
                "none of its compiled graphs has saved a tensor through GACT's hooks: GACT keeps "
                "these saves as they are, so compiling saves no activation memory here. If this "
                f"torch ({torch.__version__}) cannot resume a graph break inside a module's call "
                "(2.11 cannot, 2.13 can), it runs a compiled forward eagerly once GACT's hooks "
                "on the model's root break the graph, as they do where no module returned by "
                "torch.compile(model) wraps the model (model.compile() of a torch.nn container, "
                "or a compiled function that calls the model): compile the model with "
                "torch.compile(model) and call what it returns, or use torch 2.13 or later",
            )
            return
        self._warn_once(
            "compile",
            "the model's forward is compiled (torch.compile) and eager code between its "
            "graphs (at graph breaks) saved tensors: GACT keeps those as they are, because "
            "it cannot see the decisions their backward takes. The compiled graphs' own saves "
            "are compressed. torch._dynamo.explain(model)(x) lists the graph breaks",
        )

    def _on_unknown_use(self, site: CompiledSite) -> None:
        self._warn_once(
            "compile-use",
            f"a compiled graph saves {site.key!r}, which its backward reads in a way GACT does "
            f"not know ({site.keep}), so GACT keeps it as it is; report() lists every compiled "
            "save kept and why. Please report the operator to GACT",
        )

    # ----------------------------------------------------------------- training
    def iterate(
        self,
        closure: Callable[[], T],
        *,
        probe_closure: Callable[[], Any] | None = None,
        probe_fraction: float = 1.0,
    ) -> T | None:
        """Run one training step's forward and backward, adapting bits when due.

        Args:
            closure: runs forward, loss, ``optimizer.zero_grad()`` and ``loss.backward()``, and
                returns what the caller wants back (usually the loss). It must not call
                ``optimizer.step()``: probes run it again.
            probe_closure: the same on a sub-batch, used for sensitivity probes (default:
                ``closure``). Probes restore RNG states, buffers, gradients and module modes.
            probe_fraction: what a probe costs as a share of a training step (``probe_closure``'s
                batch over the step's), in ``(0, 1]``: it predicts the first adaptation's cost,
                which decides whether the time budget affords it; later ones are measured.

        Returns:
            What ``closure`` returned; ``None`` if the step's forward and backward had already
            run (the original GACT's loop, see NOTE [Steps]) and the closure was not run.

        Raises:
            ValueError: ``probe_fraction`` is not in ``(0, 1]``.
        """
        if self._context is None:
            raise HookStateError("iterate() called before install_hook()")
        if not 0.0 < probe_fraction <= 1.0:
            raise ValueError(f"probe_fraction must be in (0, 1], got {probe_fraction!r}")
        self.pacing.probe_fraction = probe_fraction
        self._explicit_steps = True
        self._iterated = True
        # a compiled graph that keeps all its saves runs no GACT hook: its backward shows in the
        # gradients it accumulated (NOTE [Backwards seen] in backwards.py)
        backwards = self.backwards
        ran_backward = backwards.ran_since(backwards.boundary, unpacks=bool(self.ledger.current))
        result = None
        if not ran_backward:
            try:
                result = self.run_closure(closure)
            except BaseException:
                self.ledger.discard()
                self.pacing.discard()
                raise
        try:
            if self.pacing.scheduled():  # closures may run again: what else they train
                self._closure_leaves(result)
            self._measure_compiled(closure)
            adapting = self.pacing.adapting()
            if adapting is not None:
                meter = self.pacing.disarm()
                probes = probe_closure or closure if adapting == "probes" else None
                self.adapter.adapt(probes, self.ledger.current, self.run_closure, meter)
        finally:  # a failed adaptation still ends the step the real closure completed
            self.hooks.closure_leaves = []
            self._end_step("iterate")
        return result

    def _closure_leaves(self, result: object) -> None:
        """Tell the probes what the closure trained outside the model (NOTE [Probes leave no
        trace] in probes.py)."""
        own = {id(p) for p in self.model.parameters()}
        outside = [t for t in trained_leaves(result) if id(t) not in own]
        self.hooks.closure_leaves = outside
        if outside:
            self._warn_once(
                "outside leaves",
                f"the closure trains {len(outside)} tensors outside the controlled model; "
                "probes restore their gradients, but buffers of modules outside the model "
                "(BatchNorm running statistics) are updated by every probe: give the "
                "Controller the module that holds everything the closure runs",
            )

    @property
    def adaptation_due(self) -> bool:
        """Whether the open step is one on which an adaptive level adapts with probes (NOTE
        [Adaptation schedule] in gact_policy, and NOTE [Prior allocation] in adapt.py): the
        schedule says so and the time budget affords them. A measuring step that cannot
        afford them still adapts the tensors it measured (NOTE [Held tensors] in adapt.py)."""
        return self.pacing.due

    def _measure_compiled(self, closure: Callable[[], Any]) -> None:
        """Measure the compiled graphs' saves of a measuring step on an eager run of its
        closure (NOTE [Measured compiled saves] in measured_compiled.py). Under
        torch.distributed every rank runs it or none (its backward may all-reduce): rank 0's
        meter decides, on steps whose schedule is every rank's."""
        if not (self.hooks.compiled_graphs and self.pacing.scheduled()):
            return
        meter = self.hooks.meter
        if not rank_zeros(meter is not None and bool(meter.fingerprints)):
            return
        batch_norms = self.adapter.batch_norms
        measure_eagerly(
            meter or SensitivityMeter(batch_norms=batch_norms),
            SensitivityMeter(batch_norms=batch_norms, fingerprints=True), closure,
            model=self.model, plan=self.plan, hooks=self.hooks, tracker=self.tracker,
            run_closure=self.run_closure, seed=mix_seed(self.config.seed, self.plan.step, 0xEA6E),
        )  # fmt: skip

    def run_closure(self, closure: Callable[[], T]) -> T:
        """Run ``closure`` and check that it ran a backward pass (NOTE [Backwards seen] in
        backwards.py)."""
        if not callable(closure):
            raise TypeError(f"closure must be callable, got {type(closure).__name__}")
        before = self.backwards.mark()
        result = closure()
        if not self.backwards.ran_since(before):
            raise ClosureError(
                "the closure did not run a backward pass: it must compute the loss and call "
                "loss.backward() (after optimizer.zero_grad())"
            )
        return result

    def step(self) -> None:
        """End the current step (see NOTE [Steps]); call it after ``optimizer.step()``.

        Raises:
            HookStateError: if the hooks were never installed.
        """
        if not self._ever_installed:
            raise HookStateError(
                "step() called before install_hook(): install the hooks (or enter `with "
                "controller:`) before training, then call step() after each optimizer step"
            )
        self._explicit_steps = True
        if self._last_boundary == "iterate" and not self.ledger.current:
            self._warn_once(
                "double step",
                "step() right after iterate() ignored: iterate() already ends the step, so "
                "calling both would count every batch twice; call one of them per batch",
            )
            return
        self._end_step("step")

    def _adapt_without_probes(self) -> None:
        """At a step boundary that no closure reaches (``step()``, or the next forward): adapt
        the tensors the step measured, if due, and say once that the others, which need
        probes, keep their widths (NOTE [Held tensors] in adapt.py)."""
        if not (self.ledger.current and self.pacing.adapting()):
            return
        meter = self.pacing.disarm()
        adapted = self.adapter.adapt(
            None, self.ledger.current, self.run_closure, meter, probes_later=self._iterated
        )
        if not adapted or (self.adapter.last_held and not self._iterated):
            self._warn_once(
                "no adaptation",
                f"level {self.config.level} probes sensitivities only in iterate(closure), on "
                "the steps its schedule makes due, and this model saves tensors whose "
                "sensitivity cannot be measured without probes (normalisations, attention, "
                "pointwise functions); this loop calls step() or never marks steps, so those "
                "tensors keep the widths of the prior allocation (the measured ones adapt). "
                "Call controller.iterate(closure) on those steps (see Controller.adaptation_due)",
            )

    def _end_step(self, boundary: str) -> None:
        if boundary != "iterate":
            self._adapt_without_probes()
        self.pacing.disarm()
        if self.tracker.end_step(saved=bool(self.ledger.current)):
            self._warn_once(
                "uncompiled call",
                "the model was trained through its compiled module (torch.compile(model)), "
                "which GACT's hooks then went on alone, and this step called the uncompiled "
                "model: its saved tensors were kept uncompressed. The hooks go on every module "
                "again from the next install_hook(); train through one of the two",
            )
        if self.config.spec.adaptive and not self.adapter.has_prior:
            self.adapter.allocate_prior(self.ledger.current)
        now = time.perf_counter()
        self.pacing.step_seconds += now - self._step_started
        self._step_started = now
        self.ledger.close()
        self.plan.step += 1
        self._last_boundary = boundary
        self.backwards.boundary = self.backwards.mark()
        if self.hooks.swapper is not None:
            self.hooks.swapper.new_step()

    # ----------------------------------------------------------------- resuming
    def state_dict(self) -> dict[str, Any]:
        """The run so far, for a resumed run to go on as this one would (NOTE [Resumed runs]
        in resume.py): the step count, widths, sensitivities and what adaptations learned,
        with the configuration, as plain Python values.

        Example::

            >>> import io, torch
            >>> from gact import Controller, GactConfig
            >>> model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh())
            >>> controller = Controller(model, GactConfig.from_level("L2"))
            >>> with controller:
            ...     model(torch.randn(4, 8)).sum().backward()
            ...     controller.step()
            >>> buffer = io.BytesIO()
            >>> torch.save({"gact": controller.state_dict()}, buffer)
            >>> _ = buffer.seek(0)
            >>> resumed = Controller(model, GactConfig.from_level("L2"))
            >>> resumed.load_state_dict(torch.load(buffer, weights_only=True)["gact"])
            >>> resumed.plan.step
            1
        """
        return resume.run_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on with the run ``state_dict()`` saved, on this Controller of the same model
        and configuration, before its first step or between steps.

        Raises:
            ValueError: ``state`` is not what ``state_dict()`` returns.
            ConfigError: it was saved under another configuration.
            HookStateError: the open step has saved tensors already.
        """
        resume.load_run_state(self, state)

    # ----------------------------------------------------------------- reports
    def stats(self) -> dict[str, Any]:
        """Accounting of the last completed step (see NOTE [Steps]).

        Returns:
            ``original_bytes`` (saved activations as autograd would hold them), ``stored_bytes``
            (what GACT holds: payloads, metadata, decision masks and kept tensors), ``ratio``,
            ``compressed_tensors``, ``skipped_tensors`` (kept as they are inside the model),
            ``outside_tensors`` (saved outside the model's forward, kept), ``parameter_saves``,
            ``deduplicated_saves``, ``decision_mask_bytes``, ``average_bits`` (code bits per
            quantized element), ``sites``, ``level``, ``memory_budget`` (bytes, or ``None``),
            ``step``, ``adaptations``,
            ``adaptation_overhead``: seconds spent adapting divided by all other seconds between
            step boundaries but those compiling (0.05: adapting made training 5% slower),
            ``compiled_graphs``: the forward graphs ``torch.compile`` traced GACT's hooks into so
            far, recompilations included (adapting never recompiles: a count that grows while
            training runs means something else makes dynamo recompile, such as installing the
            hooks again on a model compiled after ``install_hook()``), and
            ``compile_seconds``: the wall time of those graphs' compilations, their backwards'
            included (NOTE [Compile time] in compiled.py).
        """
        out = self.ledger.stats()
        training = self.pacing.trained_seconds()
        out.update(
            level=self.config.level,
            memory_budget=self.config.memory_budget,
            step=self.plan.step,
            adaptations=self.adapter.count,
            adaptation_overhead=self.adapter.seconds / training if training > 0 else 0.0,
            compiled_graphs=len(self.hooks.compiled_graphs),
            compile_seconds=self.hooks.compile_clock.seconds,
        )
        return out

    def report(self) -> str:
        """A per-tensor table of the last completed step: key, shape, dtype, kind, bits (with
        decision masks, zero-exact grids and exact two-valued tensors marked), sensitivity ± its
        standard error, saves, bytes and stored bytes, then the totals and a legend of the
        columns."""
        exact = {key for key, two_valued in self.plan.two_valued.items() if two_valued}
        plan = self.plan
        table = self.ledger.table(plan.sensitivity, plan.stderr, exact, plan.measured)
        kept = [s for s in self.hooks.compiled_sites.values() if s.keep is not None]
        if kept:
            lines = [f"  {site.key}: {site.keep}" for site in sorted(kept, key=lambda s: s.key)]
            table += "\nkept in compiled graphs (key: why):\n" + "\n".join(lines)
        return table
