"""How ``SaveHooks`` stores a save that no save of this forward holds yet: kept as it is,
compressed (quantized in memory-order, channel, feature or row groups, rotated, as a derivative
table, packed losslessly), or as the outcomes of its comparisons alone."""

from __future__ import annotations

import collections
from collections.abc import Callable

import gact_kernels
import torch

from . import decisions, norm_rules, pointwise, rotation
from .config import GactConfig
from .decision_spec import DecisionSpec
from .decisions import Decision
from .ledger import Kind, Ledger, occupied_bytes
from .plan import BitPlan
from .recomputed import ActivationCall
from .saved import Saved, SavedCompressed, SavedDecisions, SavedKept

__all__ = ["FEATURE_GROUP_BITS", "INTEGER_GAIN", "Storing", "feature_dim"]

_PARAM_KEY = "<parameters>"  # ledger key of every parameter/buffer save

# NOTE [Integer saves]
# Integer saves (indices, token ids, an LSTM's workspace) are packed losslessly in the bits
# each group's range needs (``gact_kernels.pack_ints``). Values that span their dtype's range
# gain nothing: an LSTM's uint8 workspace on the CPU (16 MB a layer, the model's largest saves,
# partly uninitialised memory) packed to 0.36-1.035x its bytes, differently from run to run,
# and the copy its unpack restores beside the packed one took the step's peak to 1.06-1.34x
# fp32's (1.11x where the packing had shrunk it to 0.36x: the backward's peak is that
# unpack). So a key whose packing does not shrink its bytes ``INTEGER_GAIN`` times is kept as
# it is from its next save on (``BitPlan.kept_keys``): the first save is packed (lossless
# either way), the later ones cost nothing to pack and hold what fp32 holds. Indices and token
# ids in int64 pack 8x or more, inductor's int8 max-pooling offsets (2 bits) 3.8x.
INTEGER_GAIN = 3


class Storing:
    """The part of ``SaveHooks`` that decides how a new save is stored and stores it; it reads
    the hooks' ``plan``, ``ledger``, ``pending`` and ``_verdicts`` and calls ``settle``."""

    plan: BitPlan
    ledger: Ledger
    pending: collections.deque[SavedCompressed]
    _verdicts: dict[tuple[str, str], tuple[int, int, bool]]
    settle: Callable[[], None]  # resolves the pending saves whose kernels finished

    def _decisions_only(
        self,
        key: str,
        tensor: torch.Tensor,
        spec: DecisionSpec | None,
        compact: torch.Tensor | None,
        call: ActivationCall | None,
    ) -> bool:
        """Whether a save of ``tensor``, to be compressed, is stored as the outcomes of
        ``spec``'s comparisons alone (NOTE [Decision-only saves])."""
        return (
            spec is not None
            and spec.only_decisions
            and bool(spec.predicates)
            and compact is None
            and call is None
            and tensor.is_floating_point()
            and key not in self.plan.value_read
            and decisions.representatives(spec.predicates, tensor.dtype) is not None
            and not bool(tensor.detach().sum().isnan())  # any NaN (or +inf and -inf): see the NOTE
        )

    def _store_decisions(
        self, key: str, tensor: torch.Tensor, spec: DecisionSpec, *, held_elsewhere: bool = False
    ) -> SavedDecisions:
        """``tensor`` stored as the outcomes of ``spec``'s comparisons (NOTE [Decision-only
        saves]), and counted (``held_elsewhere``: its bytes counted at another save)."""
        saved = SavedDecisions(tensor, key, spec, self.ledger.occurrences(key))
        assert saved.decision is not None
        self.ledger.record(key, tensor, Kind.DECISIONS, None, 0, held_elsewhere=held_elsewhere)
        self.ledger.add_decision(key, saved.decision.nbytes, len(saved.decision.predicates))
        return saved

    def _kept_parameter(self, tensor: torch.Tensor) -> SavedKept:
        """A save of a parameter or buffer: state, counted and kept as it is."""
        self.ledger.record(_PARAM_KEY, tensor, Kind.PARAMETER, None, 0)
        return SavedKept(tensor, _PARAM_KEY)

    def _classify(
        self,
        key: str,
        tensor: torch.Tensor,
        spec: DecisionSpec | None,
        *,
        inside: bool,
        exact: bool,
    ) -> tuple[Kind | None, torch.Tensor | None]:
        """The kind of a save kept as it is (``None``: compressed), and ``_compact(tensor)``
        where the level compresses."""
        compresses = self.plan.config.spec.compresses and tensor.layout is torch.strided
        compact = _compact(tensor) if compresses else None
        kind = Kind.KEPT if exact else self._treatment(key, tensor, compact, spec, inside)
        return kind, compact

    def _record_kept(
        self,
        key: str,
        tensor: torch.Tensor,
        kind: Kind,
        *,
        held_elsewhere: bool = False,
        beside: bool = False,
    ) -> None:
        """The ledger entry of a save stored as it is (its dtype's width if the allocation
        keeps its key at full precision); ``held_elsewhere``: another save of the step holds
        its storage, which counts there; ``beside``: kept beside a compressed save of the same
        tensor, so stored twice but held by autograd once."""
        full = self.plan.config.spec.compresses and self.plan.bits_for(key) is None
        bits = tensor.element_size() * 8 if kind is Kind.KEPT and full else None
        stored = occupied_bytes(tensor) if beside else None
        self.ledger.record(key, tensor, kind, bits, stored, held_elsewhere=held_elsewhere or beside)

    def _treatment(
        self,
        key: str,
        tensor: torch.Tensor,
        compact: torch.Tensor | None,
        spec: DecisionSpec | None,
        inside: bool,
    ) -> Kind | None:
        """The kind of a save kept as it is, or ``None`` if it is compressed (``compact``:
        ``_compact(tensor)``)."""
        if not inside:
            return Kind.OUTSIDE
        cfg = self.plan.config
        if not cfg.spec.compresses or tensor.layout is not torch.strided:
            return Kind.KEPT
        if compact is not None:  # an expanded view: its compact base is what is stored
            dense = occupied_bytes(compact) == compact.numel() * compact.element_size()
            if (spec is not None and spec.decides) or not dense:
                return Kind.KEPT
            tensor = compact
        if tensor.numel() < cfg.min_numel and not self.plan.probes(key):
            return Kind.KEPT
        if key in self.plan.kept_keys:
            return Kind.KEPT
        if tensor.dtype is torch.bool or tensor.dtype in gact_kernels.INT_DTYPES:
            return None  # packed losslessly
        if tensor.dtype not in gact_kernels.FLOAT_DTYPES or self.plan.bits_for(key) is None:
            return Kind.KEPT
        if spec is not None and (
            spec.keeps(tensor) or not decisions.representable(spec, tensor.dtype)
        ):
            return Kind.KEPT
        return None

    def _compress(
        self,
        key: str,
        tensor: torch.Tensor,
        compact: torch.Tensor | None,
        spec: DecisionSpec | None,
        *,
        occurrence: int | None = None,
        decision: Decision | None = None,
        held_elsewhere: bool = False,
    ) -> Saved:
        """Compress ``tensor`` saved at ``key`` during a call with ``spec``; ``occurrence``
        and ``decision``: those of a save stored as its decisions alone until now (NOTE
        [Decision-only saves]); ``held_elsewhere``: its bytes are counted at another save."""
        group_size = self.plan.config.group_size
        zero_exact = False
        floor = preferred = 0  # the saving call's smallest width for it, and its preferred one
        view_to: torch.Size | None = None
        table: pointwise.DerivativeTable | None = None
        rotated: rotation.Rotated | None = None
        # a GELU/SiLU input: the allocation counts a table's group header for it (see Items.of)
        candidate = spec is not None and spec.derivative_id == id(tensor)
        data = (tensor if compact is None else compact).detach()  # no autograd history below
        logged = spec is not None and compact is None and spec.log_probabilities(tensor)
        if logged:  # NOTE [Log-probabilities] in decision_rules.py
            data = data.exp()
        if tensor.dtype is torch.bool:
            payload: gact_kernels.Compressed = gact_kernels.pack_mask(data)
            kind, bits = Kind.MASK, 1
        elif tensor.dtype in gact_kernels.INT_DTYPES:
            payload = gact_kernels.pack_ints(data, group_size=group_size)
            kind, bits = Kind.PACKED, None
            if payload.nbytes * INTEGER_GAIN > data.nbytes:  # NOTE [Integer saves]
                self.plan.kept_keys.add(key)
        else:
            bits = self.plan.bits_for(key)
            assert bits is not None
            zero_exact = spec is not None and spec.zero_exact
            if zero_exact:  # 2 zero-exact bits, not 1 bit and a mask (NOTE [Exact decisions])
                bits = max(bits, 2)
            nominal = self.plan.default_bits
            if self.plan.probes(key):
                # a probe's widths respect the lower bounds the step's own saves set; floors
                # read off its sub-batch (small maps there, not in the step) would make the
                # estimator take this key's noise at one width for another's
                floor = preferred = 0
            else:  # see NOTE [Attention and row normalisations] and NOTE [Small maps]
                floor = 0 if spec is None else spec.bits_floor(tensor)
                preferred = max(
                    0 if spec is None else spec.preferred_bits(tensor, nominal),
                    norm_rules.small_map_bits(data, nominal),
                )
            bits = max(bits, floor, 0 if self.plan.allocated(key) else preferred)
            plan = self.plan
            if plan.config.spec.adaptive and key not in plan.two_valued:
                # first sight of the key: see NOTE [Two-valued tensors] in adapt.py
                plan.two_valued[key] = _two_valued(data)
            table = self._derivative_table(key, tensor, spec, bits, compact is None)
            if table is not None:
                payload = gact_kernels.pack_ints(table.codes(data), group_size=group_size)
            else:
                if occurrence is None:
                    occurrence = self.ledger.occurrences(key)
                seed = self.plan.seed_for(key, occurrence)
                rows = _row_length(spec, tensor, data, plan.config)
                channels = plan.config.channel_groups and (
                    data.dim() >= 4
                    or (  # an expanded view's base is grouped as it is
                        spec is not None
                        and spec.channels_id == id(tensor)
                        and data.shape == tensor.shape
                    )
                )
                source = data if rows is None else data.view(-1, rows)
                if (
                    rows is None
                    and not channels
                    and not zero_exact
                    and not logged  # a rotation's rounding could make a probability negative
                    and self._rotates(key, data, bits)
                ):
                    source, rotated = rotation.rotate(data, group_size=group_size, seed=seed)
                if rows is not None:
                    channel_dim: int | None = 0
                elif channels:
                    channel_dim = 1
                elif rotated is None:  # NOTE [Feature groups]
                    channel_dim = feature_dim(data, plan.config, plan.default_bits)
                else:
                    channel_dim = None
                pending = gact_kernels.quantize_async(
                    source, bits, group_size=group_size, seed=seed, zero_exact=zero_exact,
                    channel_dim=channel_dim,
                )  # fmt: skip
                payload = pending if not pending.done() else pending.result()
                if rows is not None:
                    view_to = tensor.shape
            kind = Kind.QUANTIZED
        saved = SavedCompressed(tensor, key, payload, self)
        if compact is not None:
            saved.expand_to = tensor.shape
        saved.view_to = view_to
        saved.table = table  # a table is never shared (see pack_own)
        saved.rotated = rotated
        saved.logged_by = spec if logged else None
        saved.shaped_by = spec if spec is not None and spec.shapes(tensor) else None
        held = saved.known  # lossless groups of a pending one reach the ledger when resolved
        nbytes = held.nbytes
        quantized = isinstance(held, gact_kernels.QuantizedTensor)
        self.ledger.record(
            key, tensor, kind, bits, nbytes, zero_exact=zero_exact, table=candidate,
            metadata_bits=_metadata_bits(held, nbytes) if quantized else None,
            min_bits=floor if quantized else 0,
            preferred_bits=preferred if quantized else 0, held_elsewhere=held_elsewhere,
        )  # fmt: skip
        if saved.pending:  # see NOTE [Pending saves]
            self.pending.append(saved)
            self.settle()
        if decision is not None:
            self.ledger.add_decision(key, saved.take(decision), len(decision.predicates))
        elif spec is not None and spec.predicates and kind is Kind.QUANTIZED:
            self._decide(saved, tensor, spec)
        return saved

    def _derivative_table(
        self, key: str, tensor: torch.Tensor, spec: DecisionSpec | None, bits: int, whole: bool
    ) -> pointwise.DerivativeTable | None:
        """The derivative table to store ``tensor`` with, if it qualifies (NOTE [Derivative
        tables] in pointwise.py), else ``None``."""
        if (
            spec is None
            or spec.derivative is None
            or spec.derivative_id != id(tensor)
            or not whole
            or not self.plan.config.derivative_tables
            or self.plan.probe is not None
            or bits > pointwise.MAX_TABLE_BITS
        ):
            return None
        table = pointwise.derivative_table(spec.derivative, bits)
        group_size = self.plan.config.group_size
        better = self._judged(
            "table",
            key,
            bits,
            lambda: pointwise.table_is_better(tensor, table, group_size=group_size),
        )
        return table if better else None

    def _rotates(self, key: str, data: torch.Tensor, bits: int) -> bool:
        """Whether ``data`` is quantized rotated (NOTE [Rotated groups] in rotation.py)."""
        config = self.plan.config
        if not config.rotated_groups or not data.is_contiguous():
            return False
        if data.numel() < config.group_size:
            return False
        return self._judged(
            "rotation", key, bits,
            lambda: rotation.rotation_is_better(
                data, bits, group_size=config.group_size,
                feature_dim=feature_dim(data, config, self.plan.default_bits),
            ),
        )  # fmt: skip

    def _judged(self, what: str, key: str, bits: int, judge: Callable[[], bool]) -> bool:
        """``judge()``'s verdict for ``key``'s saves, judged again when their width changes and
        every ``pointwise.REJUDGE_STEPS`` steps, not per save (NOTE [Derivative tables])."""
        step = self.plan.step
        verdict = self._verdicts.get((what, key))
        if verdict is None or verdict[0] != bits or step - verdict[1] >= pointwise.REJUDGE_STEPS:
            verdict = self._verdicts[(what, key)] = (bits, step, judge())
        return verdict[2]

    def _decide(self, saved: SavedCompressed, tensor: torch.Tensor, spec: DecisionSpec) -> None:
        added = saved.decide(tensor, spec)
        assert saved.decision is not None
        self.ledger.add_decision(saved.key, added, len(saved.decision.predicates))


def _metadata_bits(payload: gact_kernels.QuantizedTensor, nbytes: int) -> float:
    """Bits per element ``payload`` (of ``nbytes`` bytes) holds beyond its codes (group headers,
    lossless groups), plus the padding of channel groups (NOTE [channel groups] in
    gact_kernels/_layout.py) counted at 8 bits, so that the allocator never underestimates it
    at any width."""
    numel, stored = payload.numel, payload.stored_numel
    header = nbytes - (stored * payload.bits + 7) // 8
    return 8 * (header + stored - numel) / max(numel, 1)


def _row_length(
    spec: DecisionSpec | None, tensor: torch.Tensor, data: torch.Tensor, config: GactConfig
) -> int | None:
    """Elements per row when ``tensor`` is quantized in groups that never span two rows (NOTE
    [Attention and row normalisations] in decision_rules.py), else ``None``."""
    if (
        spec is None
        or spec.rows_id != id(tensor)
        or not config.channel_groups
        or spec.row_length < config.group_size // 4
        or data.shape != tensor.shape  # an expanded view's base: grouped as it is
        or not data.is_contiguous()
        or data.numel() % spec.row_length
    ):
        return None
    return spec.row_length


# NOTE [Feature groups]
# A save of rank 2 or 3 is a stack of feature vectors (tokens, nodes, samples) in its last
# dimension: the input of a linear layer, a matmul's, an activation's. Its features differ in
# scale by design (a norm's learned gains, a projection's output units, outlier features), and
# a group of 256 in memory order spans all features of a few rows, so every feature is rounded
# with the step of the largest: on the LLaMA-style decoder after 300 steps, the weight
# gradients of its linear layers carried 1.2-2.2x the rounding error with memory-order groups
# than with groups along the rows of one feature, on the ViT 1.6-5x (2 and 4 bits alike). So
# such saves are grouped like a channels-last map's channels (``channel_dim`` = the last
# dimension; the CPU kernels read the runs in place, tiled where the features come in eights):
# no group spans two features. Where the rows fill whole groups (4,096 tokens) the metadata is
# memory order's; otherwise each feature's rows are padded to whole groups (NOTE [channel
# groups] in gact_kernels/_layout.py), which the ledger counts at 8 bits per padded element
# (700 rows: 0.50 bits per element counted, against 0.25). Features need at least half a group
# of rows each (fewer would pay a group header for each). Row groups (norm inputs, NOTE
# [Attention and row normalisations] in decision_rules.py) and rotated saves (heavy tails, NOTE
# [Rotated groups] in rotation.py, now judged against feature groups) keep their layouts.
# Only at levels whose nominal width is at most FEATURE_GROUP_BITS (L1.2, L2.1, L2.2): gathering
# a feature's rows costs the kernels 1.7-2x their memory-order time (an L1 step of transformers'
# GPT-2 4x128 on the CPU went from 1.15-1.20x to 1.38-1.40x fp32's), and at 4 bits memory-order
# groups already keep the rounding below 10% of the minibatch variance on both models, whose L1
# losses feature groups did not move; at 2 bits they took the decoder's L1.2 and L2.2 losses 5-8%
# lower in every seed. The level decides, not each key's width, so that a key keeps one layout,
# and the metadata its allocation counts, whatever width an adaptation gives it: chosen per
# width, a GCN's L2.2 under a memory budget (700 rows) stored 89% of it, by level 91%, in memory
# order 95% (the padding counted at 8 bits makes the allocation leave bytes unspent).
FEATURE_GROUP_BITS = 3


def feature_dim(data: torch.Tensor, config: GactConfig, width: int) -> int | None:
    """The dimension of a save's features when it is quantized in feature groups at a level of
    nominal ``width`` (NOTE [Feature groups]), else ``None``."""
    if not config.channel_groups or width > FEATURE_GROUP_BITS:
        return None
    if data.dim() not in (2, 3) or not data.is_contiguous():
        return None
    features = data.shape[-1]
    if features < 2 or data.numel() // features < config.group_size // 2:
        return None
    return data.dim() - 1


def _two_valued(data: torch.Tensor) -> bool:
    """Whether every element of ``data`` equals its minimum or its maximum (NaN: no)."""
    if data.numel() == 0:
        return False
    lo, hi = torch.aminmax(data)
    return bool(data.eq(lo).logical_or_(data.eq(hi)).all())


def _compact(tensor: torch.Tensor) -> torch.Tensor | None:
    """The base of an expanded view (its stride-0 dimensions of size > 1 collapsed to size 1),
    or ``None`` if ``tensor`` repeats no elements that way."""
    if tensor.layout is not torch.strided or tensor.is_contiguous():  # no stride-0 repeats
        return None
    sizes, strides = tensor.shape, tensor.stride()
    if not any(st == 0 and sz > 1 for sz, st in zip(sizes, strides)):
        return None
    shape = [1 if st == 0 else sz for sz, st in zip(sizes, strides)]
    return tensor.as_strided(shape, strides, tensor.storage_offset())
