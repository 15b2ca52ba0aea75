"""Per-step accounting of saved tensors: ``Controller.stats()`` and ``Controller.report()``."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .scope import dtype_name

__all__ = ["Kind", "Ledger", "SiteRecord", "live_tensor_peak", "occupied_bytes"]

T = TypeVar("T")

# NOTE [Ledger]
# Records are aggregated per save-site key, so the ledger's size is bounded by the number of
# distinct keys, never by the number of steps or forwards (see NOTE [Save-site keys]). Bytes are
# what a tensor really occupies: indices and values of sparse layouts, and the storage of a view
# that repeats its elements (an ``expand``-ed tensor holds its storage, not ``numel`` elements).


class Kind(str, enum.Enum):
    """What happened to a saved tensor."""

    QUANTIZED = "quantized"  # per-group stochastic rounding (gact_kernels.quantize)
    MASK = "mask"  # bool mask packed losslessly at 1 bit per element
    PACKED = "packed"  # integer tensor packed losslessly in the bits its range needs
    SHAPE = "shape"  # read by the backward only for its shape, stored as the shape alone
    DECISIONS = "decisions"  # read only through comparisons: their outcomes, 1 bit each
    RECOMPUTED = "recomputed"  # an activation's intermediate, recomputed from its saved input
    KEPT = "kept"  # stored as it is (small, integer, float64, level L0, or full precision)
    OUTSIDE = "outside"  # saved outside the model's forward (e.g. the loss): kept as it is
    PARAMETER = "parameter"  # a parameter or buffer: not an activation, never compressed


_COMPRESSED = (
    Kind.QUANTIZED, Kind.MASK, Kind.PACKED, Kind.SHAPE, Kind.DECISIONS, Kind.RECOMPUTED,
)  # fmt: skip


def occupied_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` occupies (see NOTE [Ledger])."""
    layout = tensor.layout
    if layout is torch.strided and tensor.is_contiguous():  # its elements are distinct
        return tensor.nbytes
    if layout is torch.sparse_coo:
        return occupied_bytes(tensor._indices()) + occupied_bytes(tensor._values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (tensor.crow_indices(), tensor.col_indices(), tensor.values())
        return sum(occupied_bytes(p) for p in parts)
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
        return sum(occupied_bytes(p) for p in parts)
    dense = tensor.numel() * tensor.element_size()
    if layout is not torch.strided or tensor.device.type == "meta":
        return dense
    return min(dense, tensor.untyped_storage().nbytes())


@dataclass
class SiteRecord:
    """Everything saved at one key during one step."""

    key: str
    kind: Kind
    shape: tuple[int, ...]
    dtype: torch.dtype
    bits: int | None
    count: int = 0
    numel: int = 0
    original_bytes: int = 0
    stored_bytes: int = 0
    mask_bits: int = 0  # exact decision masks per element (NOTE [Exact decisions])
    mask_bytes: int = 0
    zero_exact: bool = False  # on gact-kernels' zero-exact grid (NOTE [Exact decisions])
    table: bool = False  # may be stored as a derivative table (NOTE [Derivative tables])
    # bits per element beyond the codes in the last quantized save (group headers, padding of
    # channel groups); None until the key is quantized
    metadata_bits: float | None = None
    # the smallest width the saving call allows (NOTE [Attention and row normalisations])
    min_bits: int = 0
    # the width the save takes where the level affords it (NOTE [Small maps] in norm_rules.py)
    preferred_bits: int = 0
    # saved by a reentrant checkpoint region's recomputation in the backward, held only while
    # the region's backward runs: not what the forward holds (``checkpoint_recomputation_bytes``)
    in_backward: bool = False


@dataclass
class Ledger:
    """Aggregates saves of the open step; ``close`` makes them the last completed step."""

    current: dict[str, SiteRecord] = field(default_factory=dict)
    last: dict[str, SiteRecord] | None = None
    deduplicated: int = 0
    last_deduplicated: int = 0
    recorded: int = 0  # saves recorded since the ledger was made (never reset)
    # the saves recorded now are a reentrant checkpoint's recomputation (``SaveHooks.pack``)
    recomputing_checkpoint: bool = False

    def record(
        self,
        key: str,
        tensor: torch.Tensor,
        kind: Kind,
        bits: int | None,
        stored_bytes: int | None,
        *,
        zero_exact: bool = False,
        table: bool = False,
        metadata_bits: float | None = None,
        min_bits: int = 0,
        preferred_bits: int = 0,
        held_elsewhere: bool = False,
    ) -> None:
        """Count one save of ``tensor`` at ``key``; ``stored_bytes`` is what GACT holds for
        it, ``None`` when it holds the tensor itself; ``held_elsewhere``: another save of the
        step holds the same tensor, whose bytes autograd would hold once (counted there)."""
        rec = self.current.get(key)
        shape = tuple(tensor.shape)
        if rec is None or rec.kind is not kind or rec.bits != bits:
            prior = rec
            rec = SiteRecord(key, kind, shape, tensor.dtype, bits)
            if prior is not None:  # the same site changed treatment within a step: keep totals
                rec.count, rec.numel = prior.count, prior.numel
                rec.original_bytes, rec.stored_bytes = prior.original_bytes, prior.stored_bytes
                rec.mask_bits, rec.mask_bytes = prior.mask_bits, prior.mask_bytes
            self.current[key] = rec
        rec.shape = shape
        rec.in_backward = self.recomputing_checkpoint
        rec.zero_exact = zero_exact
        rec.min_bits = min_bits
        rec.preferred_bits = preferred_bits
        rec.table = rec.table or table
        if metadata_bits is not None:
            rec.metadata_bits = metadata_bits
        original = 0 if held_elsewhere else occupied_bytes(tensor)
        self.recorded += 1
        rec.count += 1
        rec.numel += tensor.numel()
        rec.original_bytes += original
        rec.stored_bytes += original if stored_bytes is None else stored_bytes

    def add_decision(self, key: str, nbytes: int, mask_bits: int) -> None:
        """Count ``nbytes`` of exact decision masks for ``key`` (``mask_bits`` per element)."""
        rec = self.current.get(key)
        if rec is not None:
            rec.stored_bytes += nbytes
            rec.mask_bytes += nbytes
            rec.mask_bits = max(rec.mask_bits, mask_bits)

    def add_bytes(self, key: str, nbytes: int) -> None:
        """Count ``nbytes`` more stored for ``key`` in the open step (lossless groups that a
        pending quantization turned out to need: NOTE [Pending saves] in hooks.py)."""
        rec = self.current.get(key)
        if rec is not None:
            rec.stored_bytes += nbytes

    def held_elsewhere(self, key: str, tensor: torch.Tensor) -> None:
        """A later save of the step holds ``tensor``, recorded at ``key`` before: autograd
        would hold it once, so its bytes count there, not here."""
        rec = self.current.get(key)
        if rec is not None:
            rec.original_bytes -= occupied_bytes(tensor)

    def as_decisions(self, key: str) -> None:
        """The bool mask just recorded at ``key`` is an activation's decision (a compiled
        graph's): counted as eager code's decision-only saves are (NOTE [Decision-only saves]
        in saved.py)."""
        rec = self.current[key]
        rec.kind, rec.bits = Kind.DECISIONS, None
        rec.mask_bits, rec.mask_bytes = 1, rec.stored_bytes

    def forget(self, key: str, tensor: torch.Tensor, mask_bytes: int) -> None:
        """Take back one save of ``tensor`` at ``key`` in the open step, which held
        ``mask_bytes`` of decision masks alone (it is stored again otherwise)."""
        rec = self.current[key]
        self.recorded -= 1
        rec.count -= 1
        rec.numel -= tensor.numel()
        rec.original_bytes -= occupied_bytes(tensor)
        rec.stored_bytes -= mask_bytes
        rec.mask_bytes -= mask_bytes
        if not rec.count:
            del self.current[key]

    def occurrences(self, key: str) -> int:
        """How many tensors were saved at ``key`` so far in the open step."""
        rec = self.current.get(key)
        return 0 if rec is None else rec.count

    def close(self) -> None:
        if self.current:
            self.last = self.current
            self.last_deduplicated = self.deduplicated
        self.current = {}
        self.deduplicated = 0

    def discard(self) -> None:
        """Forget the open step (its forward failed)."""
        self.current = {}
        self.deduplicated = 0

    def view(self) -> tuple[dict[str, SiteRecord], int]:
        """The last completed step, or the open one if no step was completed yet."""
        if self.last is not None:
            return self.last, self.last_deduplicated
        return self.current, self.deduplicated

    def stats(self) -> dict[str, Any]:
        records, dedup = self.view()
        saves = [r for r in records.values() if r.kind is not Kind.PARAMETER]
        activations = [r for r in saves if not r.in_backward]  # what the forward holds
        original = sum(r.original_bytes for r in activations)
        stored = sum(r.stored_bytes for r in activations)
        compressed = [r for r in activations if r.kind in _COMPRESSED]
        quantized_numel = sum(r.numel for r in records.values() if r.kind is Kind.QUANTIZED)
        quantized_bits = sum(
            r.numel * r.bits for r in records.values() if r.kind is Kind.QUANTIZED and r.bits
        )
        return {
            "original_bytes": original,
            "stored_bytes": stored,
            "ratio": original / stored if stored else (math.inf if original else 1.0),
            "checkpoint_recomputation_bytes": sum(r.stored_bytes for r in saves if r.in_backward),
            "compressed_tensors": sum(r.count for r in compressed),
            "skipped_tensors": sum(r.count for r in activations if r.kind is Kind.KEPT),
            "outside_tensors": sum(r.count for r in activations if r.kind is Kind.OUTSIDE),
            "decision_mask_bytes": sum(r.mask_bytes for r in activations),
            "parameter_saves": sum(r.count for r in records.values() if r.kind is Kind.PARAMETER),
            "deduplicated_saves": dedup,
            "average_bits": quantized_bits / quantized_numel if quantized_numel else None,
            "sites": len(activations),
        }

    def table(
        self,
        sensitivity: dict[str, float],
        stderr: dict[str, float],
        exact: Collection[str],
        measured: Collection[str] = (),
    ) -> str:
        """The per-tensor report (see ``Controller.report``); ``exact`` are the keys of
        two-valued tensors, which 1 bit stores exactly (NOTE [Two-valued tensors]);
        ``measured`` those whose sensitivity was measured, not probed (NOTE [Measured
        sensitivities])."""
        records, _ = self.view()
        header = ("key", "shape", "dtype", "kind", "bits", "sensitivity", "count", "bytes",
                  "stored")  # fmt: skip
        rows = [header]
        for rec in records.values():
            rows.append(
                (
                    rec.key,
                    "-" if rec.kind is Kind.PARAMETER else "x".join(map(str, rec.shape)) or "1",
                    dtype_name(rec.dtype),
                    rec.kind.value,
                    _bits_cell(rec, rec.key in exact),
                    _sensitivity_cell(
                        sensitivity.get(rec.key), stderr.get(rec.key), rec.key in measured
                    ),
                    str(rec.count),
                    str(rec.original_bytes),
                    str(rec.stored_bytes),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        st = self.stats()
        lines.append(
            f"total: {st['original_bytes']} B -> {st['stored_bytes']} B "
            f"(ratio {st['ratio']:.2f}x, {st['compressed_tensors']} compressed, "
            f"{st['skipped_tensors']} kept, {st['outside_tensors']} outside the model)"
        )
        lines.append(
            "bits: code bits per element (z: zero-exact grid, a ReLU output's zeros stay 0 and "
            "its positives positive, no mask needed; +m: exact decision masks, 1 bit each; "
            "e: exact, a two-valued tensor such as binary features or a dropout's mask kept "
            "as floats, which 1 bit stores without error, so its sensitivity is 0 and its "
            "width is pinned); kind shape: the backward reads only the tensor's shape, which is "
            "all that is stored; kind decisions: the backward reads the tensor only through "
            "comparisons with constants (a ReLU's y > 0), whose outcomes are all that is stored "
            "(+m: one bit per element and comparison); kind recomputed: an intermediate of an "
            "activation written as several operations (transformers' gelu_new and the like), "
            "recomputed in the backward from the activation's saved input, nothing stored; "
            "sensitivity: "
            "the gradient variance a tensor adds per unit of S(b) = 1/(2^b-1)^2, smoothed over "
            "adaptations, ± one standard error of the last probed estimate (m: measured in the "
            "backward, no probe); bytes: as autograd would "
            "hold it; stored: what GACT holds (metadata and masks included)"
        )
        return "\n".join(lines)


def _bits_cell(rec: SiteRecord, two_valued: bool) -> str:
    if rec.kind is Kind.DECISIONS:
        return f"0+{rec.mask_bits}m"
    if rec.bits is None:
        return "-"
    if rec.zero_exact:
        cell = f"{rec.bits}z"
    elif two_valued and rec.bits == 1 and rec.kind is Kind.QUANTIZED:
        cell = "1e"
    else:
        cell = str(rec.bits)
    return f"{cell}+{rec.mask_bits}m" if rec.mask_bits else cell


def _sensitivity_cell(value: float | None, stderr: float | None, measured: bool) -> str:
    if value is None:
        return "-"
    if measured:
        return f"{value:.3g} m"
    return f"{value:.3g}" if not stderr else f"{value:.3g} ± {stderr:.2g}"


def live_tensor_peak(fn: Callable[[], T]) -> tuple[T, int]:
    """Run ``fn``; return what it returned and the peak bytes of CPU tensors allocated during it
    and alive at once (over those alive when it starts), from the torch profiler's allocation
    events. Unlike the resident size this does not depend on the C allocator: it is what a
    perfect allocator would need, what ``max_memory_allocated`` counts on CUDA.

    Example:
        >>> _, peak = live_tensor_peak(lambda: torch.ones(1 << 20).sum())
        >>> peak >= 4 << 20
        True
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak
