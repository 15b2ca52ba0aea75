"""The saved-tensor hooks: what is compressed, how, and what autograd holds.

# NOTE [What autograd holds]
# ``pack`` returns either the tensor itself (parameters, buffers, small, integer or float64
# tensors, level L0, keys kept at full precision) or a ``Saved`` object that owns the compressed
# payload. Autograd keeps that object alive exactly as long as it would have kept the tensor, so
# there is no side table, no reference count and nothing to leak when a backward never runs:
# the graph's death frees the payload. ``unpack`` never consumes the payload, so a second
# backward (``retain_graph=True``) works. A tensor saved by several ops (same object, same
# version) is stored and counted once, whatever the level: a weak table maps live tensors to
# what their first save returned.
"""

from __future__ import annotations

import weakref

import gact_kernels
import torch

from .ledger import Kind, Ledger
from .params import ParameterFilter
from .plan import BitPlan
from .scope import ScopeTracker
from .swap import Payload, Swapper

__all__ = ["SaveHooks", "Saved"]

_QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)
_PARAM_KEY = "<parameters>"  # ledger key of every parameter/buffer save


class Saved:
    """A compressed saved tensor, as held by autograd."""

    __slots__ = ("__weakref__", "payload", "swapper", "ticket")

    def __init__(self, payload: Payload, swapper: Swapper | None) -> None:
        self.payload = payload
        self.swapper = swapper
        self.ticket = swapper.offload(self) if swapper is not None else None

    def restore(self) -> torch.Tensor:
        payload = self.payload if self.swapper is None else self.swapper.fetch(self)
        if isinstance(payload, gact_kernels.PackedMask):
            return gact_kernels.unpack_mask(payload)
        return gact_kernels.dequantize(payload)


class _LiveTable:
    """Weak map from live tensors (same object, same version, same forward) to what ``pack``
    returned for them."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, weakref.ref, int]] = {}

    def get(self, tensor: torch.Tensor, forward: int) -> torch.Tensor | Saved | None:
        entry = self._entries.get(id(tensor))
        if (
            entry is None
            or entry[0]() is not tensor
            or entry[1] != tensor._version
            or entry[3] != forward
        ):
            return None
        return entry[2]()

    def add(self, tensor: torch.Tensor, saved: torch.Tensor | Saved, forward: int) -> None:
        ident = id(tensor)
        entries = self._entries

        def forget(ref: weakref.ref) -> None:  # either side died: the entry is useless
            current = entries.get(ident)
            if current is not None and ref in (current[0], current[2]):
                del entries[ident]

        entries[ident] = (
            weakref.ref(tensor, forget),
            tensor._version,
            weakref.ref(saved, forget),
            forward,
        )

    def clear(self) -> None:
        """Drop every entry (a new forward starts: old entries can no longer match)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class SaveHooks:
    """The ``pack``/``unpack`` pair installed by a ``Controller``.

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
        self.live = _LiveTable()
        self.unpacked = 0  # unpack calls so far: tells whether a closure ran a backward

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | Saved:
        if self.is_parameter(tensor):
            self.ledger.record(_PARAM_KEY, tensor, Kind.PARAMETER, None, 0)
            return tensor
        # Every save advances its scope's counter, deduplicated or not, so that keys never
        # depend on how earlier tensors were treated (see NOTE [Save-site keys]).
        key = self.tracker.next_key(tensor)
        hit = self.live.get(tensor, self.tracker.generation)
        if hit is not None:
            self.ledger.deduplicated += 1
            return hit
        cfg = self.plan.config
        small = tensor.numel() < cfg.min_numel and not self.plan.probes(key)
        if not cfg.spec.compresses or small or tensor.layout is not torch.strided:
            return self._keep(key, tensor, None)
        with torch.no_grad():
            if tensor.dtype is torch.bool:
                payload: Payload = gact_kernels.pack_mask(tensor.detach())
                return self._store(key, tensor, payload, Kind.MASK, 1)
            if tensor.dtype not in _QUANTIZABLE:
                return self._keep(key, tensor, None)
            bits = self.plan.bits_for(key)
            if bits is None:
                return self._keep(key, tensor, tensor.element_size() * 8)
            seed = self.plan.seed_for(key, self.ledger.occurrences(key))
            payload = gact_kernels.quantize(
                tensor.detach(), bits, group_size=cfg.group_size, seed=seed
            )
        return self._store(key, tensor, payload, Kind.QUANTIZED, bits)

    def unpack(self, saved: torch.Tensor | Saved) -> torch.Tensor:
        self.unpacked += 1
        if isinstance(saved, torch.Tensor):
            return saved
        return saved.restore()

    def _keep(self, key: str, tensor: torch.Tensor, bits: int | None) -> torch.Tensor:
        # a second save of it in this forward is a duplicate, at every level
        self.live.add(tensor, tensor, self.tracker.generation)
        self.ledger.record(key, tensor, Kind.KEPT, bits, tensor.numel() * tensor.element_size())
        return tensor

    def _store(
        self, key: str, tensor: torch.Tensor, payload: Payload, kind: Kind, bits: int
    ) -> Saved:
        saved = Saved(payload, self.swapper)
        self.live.add(tensor, saved, self.tracker.generation)
        self.ledger.record(key, tensor, kind, bits, payload.nbytes)
        return saved
