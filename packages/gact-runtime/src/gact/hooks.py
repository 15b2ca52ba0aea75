"""The saved-tensor hooks a ``Controller`` installs: whose save it is, whether this forward
holds it already, and the compiled graphs' saves."""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import gact_kernels
import torch
from torch import nn

from . import compiled, decisions, norm_rules, origins
from .compiled_sites import CompiledSite, kept_sites
from .decision_spec import DecisionSpec
from .errors import GactWarning
from .ledger import Kind, Ledger, occupied_bytes
from .live import LiveStorages, LiveTable, factor_from, reads_for_factor, storage_address
from .measured import TRIAL_BITS
from .params import ParameterFilter
from .plan import BitPlan
from .recomputed import ActivationCall
from .saved import (
    Saved,
    SavedCompressed,
    SavedDecisions,
    SavedKept,
    SavedRecomputed,
    SavedShape,
    SavedView,
)
from .scope import Frame, ScopeTracker
from .storing import Storing, feature_dim
from .swap import Swapper

if TYPE_CHECKING:
    from .measured import SensitivityMeter

__all__ = ["SaveHooks", "installed_hooks"]

# NOTE [Profiler ranges]
# Under ``torch.profiler`` every eager pack and unpack runs inside a ``gact::pack`` /
# ``gact::unpack`` range, so a trace shows what GACT costs per save beside the ops it wraps
# (``examples/speed_bench.py --profile`` reads them). Without a profiler the check is one module
# attribute read per save. Compiled graphs' traced hooks get no range: a range traced into a
# graph would become part of it.
_NO_RANGE = contextlib.nullcontext()


def _profiled(name: str) -> contextlib.AbstractContextManager[object]:
    """A profiler range named ``name`` while a profiler runs (NOTE [Profiler ranges])."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_RANGE


# NOTE [Owners]
# Saved-tensor hooks are thread-local and only the innermost pair is called, so with two
# controllers installed on one thread the last one's ``pack`` sees every save. A save belongs to
# the controller whose model's forward is running; with nested models (a controlled model inside
# another) to the one entered last. ``pack`` hands each save to its owner's ``pack_own``; saves
# made while no controlled model is running (a loss computed after ``model(x)``, another model)
# are kept as they are. ``installed_hooks`` lists the hooks installed on this thread, in order.
_installed = threading.local()


def installed_hooks() -> list[SaveHooks]:
    """The ``SaveHooks`` installed on this thread, oldest first."""
    hooks = getattr(_installed, "hooks", None)
    if hooks is None:
        hooks = _installed.hooks = []
    return hooks


class SaveHooks(Storing):
    """The ``pack``/``unpack`` pair installed by a ``Controller``. How a save it does not hold
    already is stored is the part it inherits from ``Storing`` (storing.py).

    Args:
        plan: bit widths and seeds.
        tracker: names saves (see NOTE [Save-site keys]).
        is_parameter: recognises parameters and buffers.
        ledger: per-step accounting.
        swapper: moves payloads to pinned host memory (level L3 on CUDA), or ``None``.
    """

    def __init__(
        self,
        plan: BitPlan,
        tracker: ScopeTracker,
        is_parameter: ParameterFilter,
        ledger: Ledger,
        swapper: Swapper | None,
    ) -> None:
        self.plan = plan
        self.tracker = tracker
        self.is_parameter = is_parameter
        self.ledger = ledger
        self.swapper = swapper
        self.live = LiveTable()
        self.view_blocks = LiveTable()  # base -> a compressed view of it (NOTE [Aliased saves])
        # a tensor (a view's base) -> the kept save of this forward that counted its storage
        self.kept_storages = LiveTable()
        self.shaped = LiveTable()  # tensors saved as their shape (NOTE [Shape-only saves])
        self.boundaries = LiveStorages()  # NOTE [Boundary saves], NOTE [Aliased saves]
        self.pending: collections.deque[SavedCompressed] = collections.deque()  # NOTE below
        # unpacks of saves this model's forwards made (their ``owner``), whichever hooks
        # unpacked them: tell whether a closure ran a backward (NOTE [Backwards seen] in
        # backwards.py)
        self.unpacked_inside = 0
        self.probing = False  # a ProbeSession is running its probes
        # tensors outside the model the open step's closure trained, whose gradients probes
        # restore too (NOTE [Probes leave no trace] in probes.py; set by ``iterate``)
        self.closure_leaves: list[torch.Tensor] = []
        self.meter: SensitivityMeter | None = None  # NOTE [Measured sensitivities]
        self.on_compiled: Callable[[], None] = lambda: None  # set by the Controller
        self.on_unknown_use: Callable[[CompiledSite], None] = lambda site: None
        # what install_hook() pushes: modules torch.compile can trace (NOTE [Compiled saves])
        self.modules = (
            compiled.SaveHookModule(self.pack, compiled.pack_on_thread),
            compiled.SaveHookModule(self.unpack, compiled.unpack_on_thread),
        )
        self.compiled_sites: dict[str, CompiledSite] = {}  # key -> last traced site
        self.compiled_graphs: set[int] = set()  # forward graphs traced with these hooks
        self.compressing_graphs: set[int] = set()  # those of them that compress a save
        self.compile_clock = compiled.CompileClock(self.compiled_graphs)  # NOTE [Compile time]
        self._graphs_counted: set[tuple[int, int]] = set()  # (graph, forward) in the ledger
        self._warned_missed: set[str] = set()
        # (what, key) -> (bits, plan step, verdict) of the last judgment whether a derivative
        # table ("table", NOTE [Derivative tables]) or a rotation ("rotation", NOTE [Rotated
        # groups]) beats plain rounding for the key's saves
        self._verdicts: dict[tuple[str, str], tuple[int, int, bool]] = {}

    def owner(self) -> SaveHooks | None:
        """The hooks whose model's forward is running on this thread (NOTE [Owners])."""
        installed = installed_hooks()
        if len(installed) <= 1:  # the common case: one controller on this thread
            hooks = installed[0] if installed else self
            return hooks if hooks.tracker.entered() else None
        best, tick = None, 0
        for hooks in installed:
            entered = hooks.tracker.entered()
            if entered > tick:
                best, tick = hooks, entered
        return best

    def pack(self, tensor: torch.Tensor) -> Saved | object:
        owner = self.owner()
        context = compiled.tracing_context()
        if context is not None:  # AOTAutograd traces a compiled graph's save
            return tensor if owner is None else compiled.pack_traced(owner, tensor, context)
        with _profiled("gact::pack"):  # a with block adds no frame: see origins.made_by
            if owner is None:
                return self.pack_own(tensor, inside=False)
            made_by = origins.made_by()
            # a reentrant checkpoint's recomputation: counted apart from what the forward holds
            recomputing = owner.ledger.recomputing_checkpoint = origins.recomputing_checkpoint()
            try:
                saved = owner.pack_own(tensor, inside=True, made_by=made_by)
            finally:
                if recomputing:
                    owner.ledger.recomputing_checkpoint = False
            saved.owner = owner
            return saved

    def unpack(self, saved: Saved | object) -> torch.Tensor:
        if not isinstance(saved, Saved):  # AOTAutograd traces a compiled graph's unpack
            return compiled.unpack_traced(saved, compiled.tracing_context())
        owner = saved.owner  # the innermost hooks unpack every save: count on its owner's
        if owner is not None:
            owner.unpacked_inside += 1
        with _profiled("gact::unpack"):
            if self.pending:
                self.settle()
            return saved.unpack()

    # NOTE [Pending saves]
    # On CUDA a quantization does not wait for its kernel to tell whether it stored a group
    # losslessly (NOTE [Deferred lossless check] in gact_kernels/pending.py): the save holds a
    # ``PendingQuantize``, which holds its input until then. ``pending`` lists such saves, oldest
    # first; every pack and unpack resolves those whose kernel has finished (reading one
    # page-locked byte each, no synchronisation) and, beyond ``MAX_PENDING``, waits for the
    # oldest. So the host runs at most ``MAX_PENDING`` saves ahead of the device's quantize
    # kernels (enough to keep the device busy: the model's own kernels queue between them) and
    # at most ``MAX_PENDING`` inputs are held beyond their last use, usually the last few
    # activations of the forward, which the model still holds anyway. A save is always
    # resolved before it is unpacked (``SavedCompressed.held``).
    MAX_PENDING = 4

    def settle(self) -> None:
        """Resolve the pending saves whose kernels have finished, and wait for the oldest ones
        beyond ``MAX_PENDING`` (NOTE [Pending saves])."""
        pending = self.pending
        while pending:
            saved = pending[0]
            if saved.pending:
                if len(pending) <= self.MAX_PENDING and not saved.payload.done():
                    return
                saved.resolve()
            pending.popleft()

    def forward_started(self) -> None:
        """The controlled model's root forward starts: forget the last forward's saves."""
        self.live.clear()
        self.shaped.clear()
        self.view_blocks.clear()
        self.kept_storages.clear()
        self.boundaries.clear()
        self._graphs_counted.clear()

    def traced(self, site: CompiledSite) -> None:
        """A compiled graph's save was traced with ``site``'s decision."""
        self.compiled_sites[site.key] = site
        self.compiled_graphs.add(site.graph)
        if site.keep is None:
            self.compressing_graphs.add(site.graph)
        if site.unknown_use:
            self.on_unknown_use(site)

    def pack_site(self, tensor: torch.Tensor, site: CompiledSite) -> Saved:
        """Pack, when a compiled graph runs, a save its tracing gave to ``site`` to compress
        (NOTE [Compiled saves] in compiled.py): as ``pack_own`` would, with the decisions taken
        from the compiled backward."""
        graph = (site.graph, self.tracker.generation)
        if graph not in self._graphs_counted:  # its kept saves, once per forward (not seen)
            self._graphs_counted.add(graph)
            for kept in kept_sites(site.graph):
                self.ledger.record(kept.key, kept.like, Kind.KEPT, None, None)
        # state, or a view of it (NOTE [Compiled saves] in compiled.py)
        if (site.graph_input or site.input_view) and self.is_parameter(tensor):
            return self._kept_parameter(tensor)
        key = site.key
        spec = DecisionSpec(
            site.predicates,
            zero_exact=site.zero_exact,
            min_bits=site.min_bits,
            precise_ids=frozenset({id(tensor)}),
            rows_id=id(tensor) if site.row_length else None,
            row_length=site.row_length,
            # as _batch_norm's rule in eager code
            channels_id=id(tensor) if site.batch_norm_input and tensor.dim() < 4 else None,
            extra_bits=norm_rules.BATCH_NORM_EXTRA_BITS
            if site.batch_norm_input and norm_rules.small_channels(tensor)
            else 0,
            # stored as exp(tensor)
            log_probabilities_id=id(tensor) if site.log_probabilities else None,
        )
        kind, compact = self._classify(key, tensor, spec, inside=True, exact=False)
        boundary = site.graph_input or site.graph_output  # NOTE [Boundary saves]
        if boundary:
            hit = self._live_save(tensor, by_storage=True)
            if isinstance(hit, SavedDecisions):  # NOTE [Decision-only saves]
                hit = self._read_for_values(hit, tensor)
            if isinstance(hit, SavedKept) or (
                isinstance(hit, SavedCompressed)
                and hit.table is None
                and hit.logged_by is None  # its values are exp(tensor)'s
                and not site.log_probabilities
                and kind is None
                and not spec.shapes(tensor)  # NOTE [Aliased saves]
            ):
                self.ledger.deduplicated += 1
                if isinstance(hit, SavedCompressed):
                    if hit.pending:  # as below: the graph may write its input back in place
                        hit.resolve()
                    if spec.predicates:
                        self._decide(hit, tensor, spec)
                        assert hit.decision is not None
                        hit.decision.consumers.add(compiled.COMPILED_NODE)
                return hit
        if kind is None and site.decisions_only:  # NOTE [Decision-only saves]
            decided = DecisionSpec(
                ((True, 0.0),) if site.zero_exact else site.predicates, only_decisions=True
            )
            if self._decisions_only(key, tensor, decided, compact, None):
                saved = self._store_decisions(key, tensor, decided)
                if boundary:
                    self.boundaries.add(tensor, saved, self.tracker.generation)
                _unversioned(saved, tensor)  # as below
                return saved
        if (
            self.meter is not None
            and tensor.is_floating_point()
            and (kind is None or self.plan.bits.get(key, 0) > 8)
        ):
            self.meter.compiled(key, tensor)  # NOTE [Measured compiled saves]
        if kind is not None:
            self._record_kept(key, tensor, kind)
            # the compiled code reuses the buffer once its save is packed: hold a copy
            return SavedKept(tensor.clone(), key)
        saved = self._compress(key, tensor, compact, spec)
        assert isinstance(saved, SavedCompressed)
        if site.decided:  # an activation's decision, as eager code stores it alone
            self.ledger.as_decisions(key)
        if boundary:
            self.boundaries.add(tensor, saved, self.tracker.generation)
        # The compiled code reuses the buffer, and bumps its version, once its save is packed;
        # nothing else can write to a compiled graph's intermediate: no version to check. A
        # pending quantization would read its lossless groups out of the buffer later (NOTE
        # [Pending saves]): it is resolved now, before the buffer is written again.
        if saved.pending:
            saved.resolve()
        _unversioned(saved, tensor)
        if saved.decision is not None:
            saved.decision.consumers.add(compiled.COMPILED_NODE)
        return saved

    # NOTE [Per-save cost]
    # A transformer step makes hundreds of saves, and on a GPU a step takes milliseconds, so
    # everything here runs once per save and must stay cheap: dictionary lookups, a few tensor
    # attribute reads, one kernel call per payload, one ledger update. What costs more and
    # depends only on a key is decided once per key and cached: its width (``BitPlan``), the
    # hash of its name (``BitPlan.key_hash``), whether it is two-valued (NOTE [Two-valued
    # tensors] in adapt.py), and whether a derivative table or a rotation beats rounding
    # (``_verdicts``, NOTE [Derivative tables] in pointwise.py, NOTE [Rotated groups] in
    # rotation.py). The kernels' containers are built without re-validation (NOTE [container
    # invariants] in gact_kernels/_compressed.py).
    # packages/gact-runtime/benchmarks/bench_saves.py measures what a save costs.
    def pack_own(self, tensor: torch.Tensor, *, inside: bool, made_by: str | None = None) -> Saved:
        """Pack a save made in this controller's model (or, ``inside=False``, outside every
        controlled model: then it is kept as it is); ``made_by``: ``CHECKPOINT`` when
        ``torch.utils.checkpoint`` keeps ``tensor`` for a region it will recompute,
        ``FUNCTION`` when a custom ``torch.autograd.Function`` saved it (``origins.made_by``)."""
        if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_meta:
            return SavedKept(tensor, "<unsupported>")  # tensor subclasses, meta: not ours
        if self.is_parameter(tensor):
            return self._kept_parameter(tensor)
        # Every save advances its scope's counter, deduplicated or not, so that keys never
        # depend on how earlier tensors were treated (see NOTE [Save-site keys]).
        frame = self.tracker.running()
        key = frame.next_key(tensor)
        spec = decisions.current_spec() if inside else None
        call, is_input = self._activation_call(frame, tensor) if inside else (None, False)
        if (
            spec is not None
            and spec.shape_only(tensor)
            and self.plan.config.spec.compresses  # L0 stores what PyTorch would
        ):  # NOTE [Shape-only saves]
            # autograd holds the tensor once, however many calls save it: its bytes count once
            held = self.live.get(tensor, self.tracker.generation) is not None
            self.ledger.record(key, tensor, Kind.SHAPE, None, 0, held_elsewhere=held)
            shaped = SavedShape(tensor, key)
            if not held:
                self.shaped.add(tensor, shaped, self.tracker.generation)
            return shaped
        # a compiled graph may save it again (NOTE [Boundary saves]), another call another
        # view of its storage (NOTE [Aliased saves])
        view = tensor._is_view()
        by_storage = bool(self.compiled_sites) or view
        hit = self._live_save(tensor, by_storage)
        if isinstance(hit, SavedDecisions):  # NOTE [Decision-only saves]
            hit = self._read_for_values(hit, tensor)
        if hit is None and inside:  # outside, saves are kept (NOTE [What autograd holds])
            hit = self._view_of_live_save(tensor, view)
        config = self.plan.config
        exact = (made_by == origins.CHECKPOINT and not config.compress_checkpoint_inputs) or (
            made_by == origins.FUNCTION and not config.compress_custom_functions
        )
        if inside and self.tracker.compiled():  # eager code in a compiled forward
            self.on_compiled()
            exact = True  # see NOTE [Compiled forwards] in scope.py
        stored = hit.source if isinstance(hit, SavedView) else hit
        # the arguments of a running product, followed in eager code outside recomputed
        # activations (NOTE [Products of a shared save])
        factors = decisions.product_factors() if inside and call is None else []
        refused = isinstance(stored, SavedCompressed) and (
            stored.table is not None  # only the function's own backward reads a table
            or (stored.logged_by is not None and stored.logged_by is not spec)  # or log(p)
            or exact  # a compressed copy would not do,
            or (spec is not None and spec.keeps(tensor))
            or (spec is not None and spec.shapes(tensor) and stored.shaped_by is not spec)
            # nor one with another call's width or groups (NOTE [Aliased saves]),
            or (stored is not hit and spec is not None and spec.predicates)
            # nor decisions in another shape, nor one rounding twice in a factor's gradient
            or (stored.factor_read and factor_from(tensor, factors))
        )
        if refused:  # stored again; autograd holds the tensor once (its bytes count once)
            hit = None
        if hit is not None:
            if factors and isinstance(stored, SavedCompressed) and not stored.factor_read:
                stored.factor_read = reads_for_factor(tensor, factors)
            self.ledger.deduplicated += 1
            if isinstance(hit, SavedCompressed) and spec is not None and spec.predicates:
                self._decide(hit, tensor, spec)
            if self.meter is not None:
                self._measure(hit, tensor, spec)
            if isinstance(hit, SavedRecomputed):
                hit.uses += 1
            elif is_input:
                call.saw_input(hit)  # type: ignore[union-attr]
            return hit
        kind, compact = self._classify(key, tensor, spec, inside=inside, exact=exact)
        if call is not None and not is_input and not exact and spec is None and kind is None:
            saved: Saved = SavedRecomputed(tensor, key, call)
            self.ledger.record(key, tensor, Kind.RECOMPUTED, None, 0, held_elsewhere=refused)
        elif kind is not None:
            saved = SavedKept(tensor, key)
            held = self._storage_counted(tensor, saved, view) and not refused
            self._record_kept(key, tensor, kind, held_elsewhere=held, beside=refused)
        elif self._decisions_only(key, tensor, spec, compact, call):
            assert spec is not None
            saved = self._store_decisions(key, tensor, spec, held_elsewhere=refused)
        else:
            saved = self._compress(key, tensor, compact, spec, held_elsewhere=refused)
            if factors and isinstance(saved, SavedCompressed):
                saved.factor_read = reads_for_factor(tensor, factors)
        if is_input:
            call.saw_input(saved)  # type: ignore[union-attr]
        if self.shaped:  # its bytes were counted at a save of its shape (see above)
            shaped = self.shaped.get(tensor, self.tracker.generation)
            if shaped is not None:
                self.ledger.held_elsewhere(shaped.key, tensor)
                self.shaped.discard(tensor)  # counted once
        self._hold(tensor, saved, view)
        if self.meter is not None:
            self._measure(saved, tensor, spec)
        return saved

    def _hold(self, tensor: torch.Tensor, saved: Saved, view: bool) -> None:
        """Hold ``saved`` as this forward's save of ``tensor`` (``view``: a view), for later
        saves of the same tensor, storage or block (NOTE [Boundary saves], NOTE [Aliased
        saves]); a derivative table is read by its own function alone, held for none."""
        if isinstance(saved, SavedCompressed):
            if saved.table is not None:
                return
            self._spans(tensor, saved, view)
        forward = self.tracker.generation
        self.live.add(tensor, saved, forward)
        if self.compiled_sites or view:
            self.boundaries.add(tensor, saved, forward)

    def _activation_call(
        self, frame: Frame, tensor: torch.Tensor
    ) -> tuple[ActivationCall | None, bool]:
        """The call of a recomputed activation this save is made in (``frame``), if any,
        counted with the save, and whether ``tensor`` is the call's input (NOTE [Recomputed
        activations] in recomputed.py)."""
        call = frame.call
        if call is None:
            config = self.plan.config
            recomputes = config.recompute_activations and config.spec.compresses
            call = frame.call = (
                recomputes and ActivationCall.of(frame.module, frame.args)
            ) or False
        if not call:
            return None, False
        assert isinstance(call, ActivationCall)
        call.count += 1
        return call, tensor is frame.args[0]

    def _read_for_values(
        self, decided: SavedDecisions, tensor: torch.Tensor
    ) -> SavedCompressed | None:
        """Another save reads ``tensor``, stored as its decisions alone, for its values (NOTE
        [Decision-only saves]): the tensor compressed as its first save would have been, which
        that save unpacks from now on; ``None`` if ``tensor`` is not the object saved first
        (the same storage saved by a compiled graph), to be compressed on its own."""
        self.plan.value_read.add(decided.key)
        forward = self.tracker.generation
        if self.live.get(tensor, forward) is not decided:
            return None
        decision = decided.decision
        assert decision is not None
        self.ledger.forget(decided.key, tensor, decision.nbytes)
        saved = self._compress(
            decided.key, tensor, None, decided.spec, occurrence=decided.occurrence,
            decision=decision,
        )  # fmt: skip
        assert isinstance(saved, SavedCompressed)
        decided.stored, decided.decision = saved, None
        self._hold(tensor, saved, tensor._is_view())
        if self.meter is not None:
            self._measure(saved, tensor, decided.spec)
        return saved

    def _live_save(self, tensor: torch.Tensor, by_storage: bool) -> Saved | None:
        """What this forward's save of ``tensor`` returned, if it was saved already: the same
        object, or, ``by_storage``, the same storage view (NOTE [Boundary saves], NOTE
        [Aliased saves])."""
        hit = self.live.get(tensor, self.tracker.generation)
        if hit is None and by_storage and self.boundaries:
            hit = self.boundaries.get(tensor, self.tracker.generation)
        return hit

    def _view_of_live_save(self, tensor: torch.Tensor, view: bool) -> SavedView | None:
        """``tensor`` held as this forward's compressed save of its base, or of the first
        compressed view of that base (of ``tensor`` itself if it is no view), whose block
        holds its elements (NOTE [Aliased saves])."""
        if not view:
            if not self.view_blocks:  # no view of anything compressed yet: no lookup
                return None
            return SavedView.of(tensor, self.view_blocks.get(tensor, self.tracker.generation))
        forward = self.tracker.generation
        base = tensor._base
        held = self.live.get(base, forward)
        if isinstance(held, SavedDecisions):  # NOTE [Decision-only saves]
            held = self._read_for_values(held, base)
        found = SavedView.of(tensor, held)
        return found or SavedView.of(tensor, self.view_blocks.get(base, forward))

    def _storage_counted(self, tensor: torch.Tensor, saved: SavedKept, view: bool) -> bool:
        """Whether a kept save of this forward counted the whole storage of ``tensor`` (of its
        base, for a view): autograd holds the storage once, so its bytes count there. Else
        ``saved`` becomes that save if it counts the whole storage itself (a view saved before
        its base, or two views of one storage, count once in either order)."""
        if tensor.layout is not torch.strided:  # sparse: no storage to share
            return False
        root = tensor._base if view else tensor
        forward = self.tracker.generation
        if self.kept_storages.get(root, forward) is not None:
            return True
        if occupied_bytes(tensor) == tensor.untyped_storage().nbytes():
            self.kept_storages.add(root, saved, forward)
        return False

    def _spans(self, tensor: torch.Tensor, saved: SavedCompressed, view: bool) -> None:
        """Record where the elements of ``saved`` lie, if they fill a dense block as they
        unpack, for views of them (NOTE [Aliased saves])."""
        if (
            saved.unpacked_stride() != tensor.stride()  # gaps, overlaps, tables, expanded
            or tensor.is_conj()  # lazy bits: other values than the storage's
            or tensor.is_neg()
        ):
            return
        saved.span = (
            storage_address(tensor),
            tensor.storage_offset(),
            tensor.numel(),
            tensor.is_contiguous(),
        )
        if view:
            forward = self.tracker.generation
            if self.view_blocks.get(tensor._base, forward) is None:
                self.view_blocks.add(tensor._base, saved, forward)

    def _measure(self, saved: Saved, tensor: torch.Tensor, spec: DecisionSpec | None) -> None:
        """Show the meter a save of ``tensor`` made during a call with ``spec`` (NOTE [Measured
        sensitivities] in measured.py): a quantized one or a derivative table, or one kept at
        full precision by an allocation, with a throwaway quantization of any part of it."""
        assert self.meter is not None

        # memory order or feature groups, as a quantized save of rank 2-3 (not a channel map's)
        def trial(part: torch.Tensor) -> gact_kernels.QuantizedTensor:
            seed, config = self.plan.seed_for("<trial>", 0), self.plan.config
            features = feature_dim(part, config, self.plan.default_bits)
            return gact_kernels.quantize(
                part.detach(), TRIAL_BITS, group_size=config.group_size, seed=seed,
                channel_dim=features,
            )  # fmt: skip

        if isinstance(saved, (SavedCompressed, SavedView)):
            view = isinstance(saved, SavedView)
            source = saved.source if view else saved
            if isinstance(source.known, gact_kernels.QuantizedTensor) or source.table is not None:
                # the meter reads the payload in the saved tensor's shape
                self.meter.saved(source, tensor, spec, trial, readable=not view or saved.rows)
        elif self.plan.bits.get(saved.key, 0) > 8:  # not quantizable otherwise: not an item
            self.meter.kept(saved.key, tensor, spec, trial)

    def missed_decision(self, key: str, node: str) -> None:
        """A compressed tensor reached a deciding backward node without exact masks (an
        operator whose Python entry point ``DecisionMode`` does not know): keep ``key`` exact
        from the next forward on."""
        self.plan.kept_keys.add(key)
        if key not in self._warned_missed:
            self._warned_missed.add(key)
            warnings.warn(
                f"{node} read the compressed tensor saved at {key!r} without an exact mask "
                "(to take a decision, find ties or divide by it), so this gradient may be "
                "biased; the tensor is kept uncompressed from the next forward on. Please "
                "report the operator that saved it to GACT.",
                GactWarning,
                stacklevel=2,
            )


def _unversioned(saved: SavedCompressed | SavedDecisions, tensor: torch.Tensor) -> None:
    """A compiled graph's save: its buffer has no version to check (see ``pack_site``)."""
    saved.witness = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    saved.version = 0
