"""The saved-tensor hooks: what is compressed, how, and what autograd holds."""

from __future__ import annotations

import abc
import collections
import contextlib
import math
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import gact_kernels
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import compiled, decisions, pointwise, rotation
from .compiled_sites import CompiledSite, kept_sites
from .config import GactConfig
from .decisions import DECISION_NODES, Decision, DecisionSpec
from .errors import GactError, GactWarning
from .ledger import Kind, Ledger, occupied_bytes
from .measured import TRIAL_BITS
from .params import ParameterFilter
from .plan import BitPlan
from .recomputed import ActivationCall
from .scope import Frame, ScopeTracker
from .swap import Swapper, Ticket

if TYPE_CHECKING:
    from .measured import SensitivityMeter

__all__ = [
    "SaveHooks", "Saved", "SavedCompressed", "SavedDecisions", "SavedKept", "SavedRecomputed",
    "SavedShape", "SavedView", "installed_hooks",
]  # fmt: skip

_PARAM_KEY = "<parameters>"  # ledger key of every parameter/buffer save

# NOTE [What autograd holds]
# ``pack`` returns a ``Saved``: ``SavedKept`` holds the tensor itself (parameters, buffers, small,
# integer or float64 tensors, level L0, keys kept at full precision, saves outside the model's
# forward); ``SavedCompressed`` owns the compressed payload; ``SavedShape`` holds a shape alone
# (NOTE [Shape-only saves] in decisions.py); ``SavedDecisions`` the outcomes of comparisons
# (NOTE [Decision-only saves]); ``SavedView`` holds another save of its data (NOTE
# [Aliased saves]). Autograd keeps that object alive
# exactly as long as it would have kept the tensor, so there is no side table, no reference count
# and nothing to leak when a backward never runs: the graph's death frees the payload. ``unpack``
# never consumes the payload, so a second backward (``retain_graph=True``) works. A tensor saved
# by several ops (same object, version, storage and forward: ``tensor.data = ...`` swaps the
# storage and keeps the version) is stored and counted once, whatever the level: a weak table
# maps live tensors to what their first save returned.
#
# NOTE [Version check]
# With saved-tensor hooks installed autograd no longer checks that a saved tensor was not
# modified in place before backward; the hooks do it. Every ``Saved`` records the tensor's
# ``_version`` at pack and compares at unpack, raising PyTorch's own message on a mismatch.
# ``SavedKept`` reads the version of the tensor it holds (or of its ``detach()``-ed alias: same
# version counter). ``SavedCompressed`` must not hold the original's storage, so it holds a
# *version witness*: a ``detach()``-ed alias whose storage is then released with ``set_()``. It
# shares the original's version counter (in-place changes through any view or alias show) and
# outlives the original. ``set_()`` itself bumps the shared counter, so the witness puts the
# value back with ``torch._C._autograd._unsafe_set_version_counter`` (what
# ``torch.autograd.graph._unsafe_preserve_version_counter`` does).


def _version_witness(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor sharing ``tensor``'s version counter (see NOTE [Version check])."""
    version = tensor._version
    witness = tensor.detach()
    witness.set_()
    torch._C._autograd._unsafe_set_version_counter((witness,), (version,))
    return witness


def _address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (0 for a layout without one): ``tensor.data = ...``
    changes it and not the version."""
    return tensor.untyped_storage().data_ptr() if tensor.layout is torch.strided else 0


def _describe(dtype: torch.dtype, device: torch.device, shape: Sequence[int]) -> str:
    """``[torch.FloatTensor [16, 256]]``, as PyTorch names tensors in its messages."""
    name = torch.empty((), dtype=dtype).type().replace("torch.", f"torch.{device.type}.")
    return f"[{name.replace('torch.cpu.', 'torch.')} [{', '.join(map(str, shape))}]]"


class Saved(abc.ABC):
    """What autograd holds for one saved tensor; ``unpack`` gives the tensor back."""

    __slots__ = ("__weakref__", "key", "node", "output_nr", "version")

    def __init__(self, tensor: torch.Tensor, key: str) -> None:
        self.key = key
        self.version = tensor._version
        self.node = None if tensor.grad_fn is None else type(tensor.grad_fn)
        self.output_nr = tensor.output_nr

    @abc.abstractmethod
    def unpack(self) -> torch.Tensor:
        """The saved tensor, checked against in-place changes since pack."""

    @abc.abstractmethod
    def _describe(self) -> str:
        """The tensor as PyTorch's in-place error message names it."""

    def unpacked_stride(self) -> tuple[int, ...] | None:
        """The strides of the tensor ``unpack`` returns, where known without unpacking."""
        return None

    def _check(self, tensor: torch.Tensor) -> None:
        """Raise PyTorch's message (so searches find it) if ``tensor`` changed since pack."""
        if tensor._version == self.version:
            return
        what = self._describe()
        if self.node is not None:
            what += f", which is output {self.output_nr} of {self.node.__name__},"
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {what} is at version {tensor._version}; expected version "
            f"{self.version} instead. Hint: GACT saved it at {self.key!r} (saved-tensor hooks "
            "switch PyTorch's own check off, so GACT checks); enable anomaly detection to find "
            "the operation that failed to compute its gradient, with "
            "torch.autograd.set_detect_anomaly(True)."
        )


class SavedKept(Saved):
    """A saved tensor held as it is.

    A non-leaf is held through ``detach()`` (same storage, same version counter): an op's own
    output holds its ``grad_fn``, which holds this object, and that cycle runs through C++
    where Python's collector cannot break it. Autograd restores the history at unpack.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor, key: str) -> None:
        super().__init__(tensor, key)
        self.tensor = tensor if tensor.grad_fn is None else tensor.detach()

    def _describe(self) -> str:
        return _describe(self.tensor.dtype, self.tensor.device, self.tensor.shape)

    def unpacked_stride(self) -> tuple[int, ...] | None:
        return self.tensor.stride()

    def unpack(self) -> torch.Tensor:
        self._check(self.tensor)
        return self.tensor


class SavedShape(Saved):
    """A saved tensor whose backward reads only its shape: holds nothing else (NOTE
    [Shape-only saves] in decisions.py). Unpacks to one NaN expanded to that shape."""

    __slots__ = ("shape", "witness")

    def __init__(self, tensor: torch.Tensor, key: str) -> None:
        super().__init__(tensor, key)
        self.witness = _version_witness(tensor)
        self.shape = tensor.shape

    def _describe(self) -> str:
        return _describe(self.witness.dtype, self.witness.device, self.shape)

    def unpack(self) -> torch.Tensor:
        self._check(self.witness)
        nan = torch.full((), math.nan, dtype=self.witness.dtype, device=self.witness.device)
        return nan.expand(self.shape)


# NOTE [Decision-only saves]
# ReLU saves its output and its backward reads it only as ``y > 0``; LeakyReLU, Hardtanh, ReLU6,
# Hardsigmoid, threshold, clamp, the shrinks and abs read their saves only through comparisons with
# constants too (``DecisionSpec.only_decisions``). A save of such a call that no save of this
# forward holds yet is stored as the outcomes of those comparisons alone (``SavedDecisions``: a
# ``PackedMask`` per comparison, 1 bit per element each), and unpacks to a representative of each
# element's region (``Decision.values``: 0 and 1 for a ReLU), so its gradient is fp32's bit for bit.
# NaNs have no region (no comparison is true of them, and each backward treats them its own way: a
# ReLU's passes the gradient, a LeakyReLU's scales it), so a tensor holding one is compressed as
# usual (its NaN groups kept exactly; so is one holding both infinities); finding out reads a sum
# off the device, which on a GPU waits for the forward so far, once per such save (few per step: a
# first step's ReLU outputs, later those only the ReLU reads). Where nothing else reads the tensor
# (a ResNet stem's ReLU output, which the max pooling reads for its shape alone: NOTE [Shape-only
# saves] in decisions.py; a ReLU before dropout) that is 1 bit per element instead of the level's
# width and group headers (4 zero-exact bits and more at L1), and the tensor is no item of the
# allocation. Usually a later call saves the same tensor for its values (the next convolution): that
# save compresses it then, as its first save would have been compressed (same key, occurrence, seed
# and spec; the decisions the first call's backward consumes, less the mask the zero-exact grid
# makes needless), the first save unpacks that payload, and the masks are freed, so the step stores
# and rounds exactly what it did before; a save of a view of it (a classifier's flattened input)
# likewise, held as that payload (NOTE [Aliased saves]). The key joins ``BitPlan.value_read`` and is
# compressed at its first save from the next forward on. A save of the same storage by a compiled
# graph (another tensor object) is compressed on its own instead (only that step holds the masks
# beside it). The masks stay on the device when saves are swapped out, as the decision masks of
# compressed saves do.
class SavedDecisions(Saved):
    """A save read only through comparisons with constants: holds their outcomes (NOTE
    [Decision-only saves]), or, once another save read the tensor for its values, unpacks
    the payload that save compressed."""

    __slots__ = ("decision", "occurrence", "shape", "spec", "stored", "witness")

    def __init__(self, tensor: torch.Tensor, key: str, spec: DecisionSpec, occurrence: int) -> None:
        super().__init__(tensor, key)
        self.witness = _version_witness(tensor)
        self.shape = tensor.shape
        self.spec, self.occurrence = spec, occurrence  # to compress it as it would have been
        self.decision: Decision | None = Decision(tensor, spec)
        self.stored: SavedCompressed | None = None

    def _describe(self) -> str:
        return _describe(self.witness.dtype, self.witness.device, self.shape)

    def unpack(self) -> torch.Tensor:
        if self.stored is not None:
            return self.stored.unpack()
        self._check(self.witness)
        assert self.decision is not None
        return self.decision.values(self.witness.dtype)


class SavedCompressed(Saved):
    """A compressed saved tensor: a ``gact_kernels.Compressed`` payload (or its swap ticket) and
    the exact decisions of the backward functions that branch on it (see NOTE [Exact decisions]
    in decisions.py), or the derivative table its codes index (NOTE [Derivative tables] in
    pointwise.py)."""

    __slots__ = (
        "decision", "expand_to", "hooks", "logged_by", "payload", "rotated", "span", "table",
        "ticket", "view_to", "witness",
    )  # fmt: skip

    def __init__(
        self,
        tensor: torch.Tensor,
        key: str,
        payload: gact_kernels.Compressed | gact_kernels.PendingQuantize,
        hooks: SaveHooks,
    ) -> None:
        super().__init__(tensor, key)
        self.witness = _version_witness(tensor)
        self.expand_to: torch.Size | None = None  # the payload is an expanded view's base
        self.view_to: torch.Size | None = None  # the payload holds the tensor's rows (2-D)
        self.hooks = hooks
        self.decision: Decision | None = None
        self.table: pointwise.DerivativeTable | None = None
        self.rotated: rotation.Rotated | None = None  # NOTE [Rotated groups]
        # the call whose log-probabilities are stored as probabilities (NOTE [Log-probabilities]
        # in decisions.py): unpacked as their log, shared with that call's saves alone
        self.logged_by: DecisionSpec | None = None
        # the dense block its elements fill as it unpacks, if they do (NOTE [Aliased saves]):
        # the storage's address, the offset of the first element, their count, contiguous
        self.span: tuple[int, int, int, bool] | None = None
        swapper = hooks.swapper
        if swapper is not None and isinstance(payload, gact_kernels.PendingQuantize):
            payload = payload.result()  # a swapped-out payload is final
        self.ticket: Ticket | None = None if swapper is None else swapper.offload(payload)
        self.payload = payload if self.ticket is None else None

    @property
    def held(self) -> gact_kernels.Compressed:
        """The payload, wherever it waits (here or swapped out); waits for a pending
        quantization (NOTE [Pending saves])."""
        if self.ticket is not None:
            return self.ticket.payload
        if isinstance(self.payload, gact_kernels.PendingQuantize):
            return self.resolve()
        return self.payload

    @property
    def known(self) -> gact_kernels.Compressed:
        """The payload as far as it is known without waiting: a pending quantization's
        provisional container (final metadata, ``nbytes`` a lower bound)."""
        held = self.payload if self.ticket is None else self.ticket.payload
        return held.provisional if isinstance(held, gact_kernels.PendingQuantize) else held

    @property
    def pending(self) -> bool:
        """Whether the payload is a quantization whose lossless check has not been read."""
        return isinstance(self.payload, gact_kernels.PendingQuantize)

    def resolve(self) -> gact_kernels.Compressed:
        """Wait for the pending quantization (if it has not finished) and hold its result;
        lossless groups it turned out to need are added to the ledger."""
        pending = self.payload
        if not isinstance(pending, gact_kernels.PendingQuantize):
            return pending  # resolved meanwhile (the hooks' settle and an unpack)
        self.payload = payload = pending.result()
        extra = payload.nbytes - pending.provisional.nbytes
        if extra:
            self.hooks.ledger.add_bytes(self.key, extra)
        return payload

    @property
    def nbytes(self) -> int:
        """Bytes held: the payload (wherever it waits) and the decision masks."""
        return self.held.nbytes + (0 if self.decision is None else self.decision.nbytes)

    def take(self, decision: Decision) -> int:
        """Hold ``decision``, made where the tensor was stored as its decisions alone (NOTE
        [Decision-only saves]), less the mask the zero-exact grid makes needless; returns the
        bytes it holds."""
        skip = self._decided_by_grid()
        if skip is not None:
            decision.drop(skip)
        self.decision = decision
        return decision.nbytes

    def _decided_by_grid(self) -> tuple[bool, float] | None:
        """The comparison the stored values decide exactly: ``y > 0`` on the zero-exact grid
        (NOTE [Exact decisions]); its grid is final, no need to wait for a pending
        quantization."""
        held = self.known
        zero_exact = isinstance(held, gact_kernels.QuantizedTensor) and held.zero_exact
        return (True, 0.0) if zero_exact else None

    def decide(self, tensor: torch.Tensor, spec: DecisionSpec) -> int:
        """Record the exact outcomes of ``spec``'s comparisons; returns the bytes added."""
        skip = self._decided_by_grid()
        if self.decision is None:
            self.decision = Decision(tensor, spec, skip=skip)
            return self.decision.nbytes
        return self.decision.extend(tensor, spec, skip=skip)

    def _describe(self) -> str:
        table_or_rotated = self.table is not None or self.rotated is not None
        dtype = self.witness.dtype if table_or_rotated else self.held.dtype
        return _describe(dtype, self.witness.device, self.held.shape)

    def unpacked_stride(self) -> tuple[int, ...] | None:
        if (
            self.table is not None
            or self.logged_by is not None  # not the storage's values: no view reads them
            or self.expand_to is not None
            or self.view_to is not None
        ):
            return None
        return tuple(self.known.stride)  # the payload restores these (its final metadata)

    def unpack(self) -> torch.Tensor:
        self._check(self.witness)
        if self.ticket is not None:
            payload = self.hooks.swapper.fetch(self.ticket)
        else:
            payload = self.held
        values = gact_kernels.decompress(payload)
        node = torch._C._current_autograd_node()
        if self.table is not None:
            if node is not None and decisions.node_family(node) != self.table.node:
                raise GactError(
                    f"{type(node).__name__} unpacked the input of a {self.table.function} call "
                    f"saved at {self.key!r} as a derivative table, which only "
                    f"{self.table.node} may read. This is a GACT bug: please report it; "
                    "GactConfig(derivative_tables=False) avoids it"
                )
            return self.table.values(values, self.witness.dtype)
        if self.rotated is not None:
            values = self.rotated.restore(values)
        if self.logged_by is not None:
            values = values.log_()
        if self.expand_to is not None:
            return values.expand(self.expand_to)  # never a decision input (see _treatment)
        if self.view_to is not None:
            values = values.view(self.view_to)
        if node is None or not isinstance(payload, gact_kernels.QuantizedTensor):
            return values
        name = type(node).__name__
        if self.decision is not None and name in self.decision.consumers:
            return self.decision.project(values)
        if decisions.node_family(node) in DECISION_NODES:
            self.hooks.missed_decision(self.key, name)
        return values


class SavedView(Saved):
    """A save of a view whose elements lie in the dense block of storage another save of this
    forward compressed, held as that save (NOTE [Aliased saves]). Unpacks to the view of the
    other save's tensor with this one's shape, strides and offset."""

    __slots__ = ("offset", "rows", "shape", "source", "stride")

    def __init__(self, tensor: torch.Tensor, source: SavedCompressed, offset: int) -> None:
        super().__init__(tensor, source.key)
        self.source, self.offset = source, offset
        self.shape, self.stride = tensor.shape, tensor.stride()
        # whether the view reads all of the block in memory order: the meter then reads the
        # payload in the view's shape (NOTE [Measured sensitivities] in measured.py)
        assert source.span is not None
        _, _, numel, contiguous = source.span
        self.rows = (
            offset == 0 and numel == tensor.numel() and contiguous and tensor.is_contiguous()
        )

    @classmethod
    def of(cls, tensor: torch.Tensor, source: Saved | None) -> SavedView | None:
        """``tensor`` held as ``source``, if its elements lie in ``source``'s block."""
        if not isinstance(source, SavedCompressed) or source.span is None:
            return None
        storage, start, numel, _ = source.span
        if (
            _address(tensor) != storage  # ``.data`` swapped since
            or tensor.dtype != source.witness.dtype
            or tensor.is_conj()  # lazy bits: other values (no span records them)
            or tensor.is_neg()
            or tensor.numel() == 0
        ):
            return None
        first = tensor.storage_offset() - start
        last = first + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))
        if first < 0 or last >= numel:
            return None
        return cls(tensor, source, first)

    def _describe(self) -> str:
        return _describe(self.source.witness.dtype, self.source.witness.device, self.shape)

    def unpack(self) -> torch.Tensor:
        self._check(self.source.witness)  # the view's own message (one version counter)
        values = self.source.unpack()
        if values.stride() != self.source.unpacked_stride():
            raise GactError(
                f"the save at {self.key!r} unpacked with strides {values.stride()}, not "
                f"{self.source.unpacked_stride()}, so a view of it cannot be read back. This is "
                "a GACT bug: please report it"
            )
        return values.as_strided(self.shape, self.stride, values.storage_offset() + self.offset)


class SavedRecomputed(Saved):
    """A save made inside a call of a recomputed activation, other than its input: holds no
    data, and unpacks to what recomputing the call gives at its position (NOTE [Recomputed
    activations] in recomputed.py)."""

    __slots__ = ("call", "index", "like", "uses", "witness")

    def __init__(self, tensor: torch.Tensor, key: str, call: ActivationCall) -> None:
        super().__init__(tensor, key)
        self.witness = _version_witness(tensor)
        self.call, self.index = call, call.count - 1
        call.handles.add(self.index)
        self.like = (tensor.shape, tensor.dtype, tensor.stride())
        self.uses = 1  # unpacks per backward: more where the same tensor was saved again

    def _describe(self) -> str:
        return _describe(self.witness.dtype, self.witness.device, self.like[0])

    def unpack(self) -> torch.Tensor:
        self._check(self.witness)
        return self.call.take(self.index, self.uses, self.like)


class _LiveTable:
    """Weak map from live tensors (same object, version, storage and forward) to what ``pack``
    returned for them."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, weakref.ref, int, int]] = {}

    def get(self, tensor: torch.Tensor, forward: int) -> Saved | None:
        entry = self._entries.get(id(tensor))
        if (
            entry is None
            or entry[0]() is not tensor
            or entry[1] != tensor._version
            or entry[3] != forward
            or entry[4] != _address(tensor)
        ):
            return None
        return entry[2]()

    def add(self, tensor: torch.Tensor, saved: Saved, forward: int) -> None:
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
            _address(tensor),
        )

    def discard(self, tensor: torch.Tensor) -> None:
        """Drop ``tensor``'s entry, if any."""
        self._entries.pop(id(tensor), None)

    def clear(self) -> None:
        """Drop every entry (a new forward starts: old entries can no longer match)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# NOTE [Boundary saves]
# A tensor a compiled graph returns and saves (a block ending in ReLU), and that the next graph
# or eager code saves again (the next block's first layer), reaches the hooks as two different
# Python objects, both aliases of one storage: AOTAutograd saves a ``detach`` of the output,
# and a graph's input may arrive as an alias of the caller's tensor. The live table above,
# keyed by object, does not see them as one, so such a tensor was stored twice, as two
# independent roundings (four tanh blocks compiled alone stored 1.7x, under aot_eager, and 1.5x,
# under inductor, what eager code stores; ``stats()`` counted it twice in the bytes autograd
# would hold, too). ``_LiveStorages`` maps
# the saves at a compiled graph's boundary (its inputs and outputs), and while any compiled
# graph has saved, eager saves too, by storage, offset, shape, strides and dtype, to what their
# first save stored. Only boundaries: compiled code reuses an intermediate's buffer, unseen by
# its version counter, once its save is packed, but never an output it returned nor an input it
# was given. A weak reference to the storage keeps its address from being reused while the
# entry lives and tells when it died; the version counter, shared by every alias, tells an
# in-place change.

# NOTE [Aliased saves]
# Eager code saves aliases too: a linear layer on a 3-D input saves its own 2-D view of it
# (``input.view(-1, d)`` inside ``matmul``), so the queries, keys and values of a transformer
# (and a gated MLP's gate and up projections) save three (two) distinct view objects of one
# storage. PyTorch holds that storage once; keyed by object, GACT stored and rounded it three
# times (14-15% of the saved bytes of the model matrix's LLaMA-style decoder and ViT). So
# every eager save that is a view (``_is_view()``, 0.1 us) is also mapped by storage, offset,
# shape, strides, dtype and the lazy conjugate and negative bits (``h.conj()`` and
# ``torch._neg_view(h)`` alias ``h`` with other values: without the bits in the key, the
# gradient of ``h * h.conj()`` came out wrong), and a view that misses the object table is
# looked up there.
# Eager code never writes into a live storage behind its version counter, which every view
# shares with its base, and the weak reference to the storage tells when it died (its address
# may then be reused). The readers of one stored rounding are different calls, so each adds
# its own error to its own parameters' gradients, each unbiased; a key's measured sensitivity
# sums its readers' terms (NOTE [Measured sensitivities] in measured.py). A call that asks its
# save for a width or groups of its own (``DecisionSpec.shapes``: a fused attention's queries
# and keys, a BatchNorm input on small maps, a norm's rows) does not reuse a compressed save
# another call made, alias or the same object, nor does a compiled graph's boundary save
# that needs one (a compiled fused attention's queries): the queries saved first by a
# product at the level's width were read by the attention's backward at that width, 2 bits
# short in eager code and 2 below ``ATTENTION_BITS`` in a compiled graph.
# A view in another shape, or of part of the elements, is its own key there, so the output of an
# activation that saves it (ReLU, tanh, sigmoid) on a tokens-by-features batch was stored again by
# the next linear layer's 2-D view of it, and an attention's output by the output projection's
# view of it (PyTorch's ``nn.TransformerEncoderLayer`` with ReLU and no dropout stored 1.31x what
# it stores now, a tanh MLP on tokens 1.32x). So a compressed save records the dense block its
# elements fill as it unpacks (``SavedCompressed.span``: none for tables, lazily negated or
# conjugated tensors and tensors with gaps or overlaps, which unpack contiguous), and a view that
# misses both tables and whose elements all lie in the block of its base's save, or of the first
# compressed view of that base (a base saved after a view of it too), is held as that save
# (``SavedView``: unpacked with the view's shape, strides and offset by ``as_strided``), if it is
# saved in the model and its storage is still the one the block was recorded on (``tensor.data =
# ...`` swaps a storage without a new version). The meter reads a payload in the saved tensor's
# shape, so only a view of the whole block in memory order is measured through it
# (``SavedView.rows``); the readers of other views are probed.


class _LiveStorages:
    """Weak map from live storages (same storage, offset, shape, strides, dtype, lazy
    conjugate and negative bits, version and forward) to what ``pack`` returned for a tensor
    on them (NOTE [Boundary saves], NOTE [Aliased saves])."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[StorageWeakRef, int, weakref.ref, int]] = {}

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple:
        return (
            tensor.untyped_storage()._cdata, tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype, tensor.is_conj(), tensor.is_neg(),
        )  # fmt: skip

    def get(self, tensor: torch.Tensor, forward: int) -> Saved | None:
        entry = self._entries.get(self._key(tensor))
        if (
            entry is None
            or entry[0].expired()
            or entry[1] != tensor._version
            or entry[3] != forward
        ):
            return None
        return entry[2]()

    def add(self, tensor: torch.Tensor, saved: Saved, forward: int) -> None:
        storage = tensor.untyped_storage()
        self._entries[self._key(tensor)] = (
            StorageWeakRef(storage),
            tensor._version,
            weakref.ref(saved),
            forward,
        )

    def clear(self) -> None:
        """Drop every entry (a new forward starts: old entries can no longer match)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# NOTE [Checkpointed regions]
# Non-reentrant ``torch.utils.checkpoint`` is itself a pair of saved-tensor hooks: inside a
# region its hooks are the innermost, so GACT never sees what the region saves, neither in the
# forward nor when the backward recomputes it (those tensors are held exact, and only while the
# region's backward runs). What the checkpoint keeps, the region's inputs, it saves through the
# hooks outside the region: GACT's. Compressing them would make the recomputation run on the
# dequantized input, and the region's gradient that of a perturbed input: the exact-decision
# guarantee (NOTE [Exact decisions] in decisions.py) is lost, because the recomputed ReLUs
# decide on the rounded values. On three checkpointed Linear-ReLU-Linear blocks at 4 bits the
# mean gradient over 200 seeds was 26% off the fp32 one (GACT without checkpointing: within
# noise), and the inputs are a small part of the peak (BENCHMARKS.md, "GACT against
# checkpointing"). So they are kept as they are unless ``compress_checkpoint_inputs`` is set.
# (Reentrant checkpointing recomputes through the hooks of the thread: GACT compresses those
# recomputed saves, which live only while the region's backward runs.)
# They are recognised by the Python code that made the save: a function of torch's
# checkpoint.py (the non-reentrant ``save_inputs``; the reentrant ``checkpoint``, through
# ``Function.apply``, whose ``CheckpointFunction`` saves them with ``save_for_backward``).
_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")
_FUNCTION_FILE = os.path.join("torch", "autograd", "function.py")


def _from_checkpoint() -> bool:
    """Whether the save being packed was made by torch's checkpoint.py (NOTE [Checkpointed
    regions]): directly (non-reentrant), or through ``Function.apply`` (reentrant)."""
    try:
        frame = sys._getframe(2)  # _from_checkpoint <- pack <- the code that saved
    except ValueError:  # no Python code made it (a save on a thread of PyTorch's own)
        return False
    code = frame.f_code
    if code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_FILE):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.endswith(_CHECKPOINT_FILE)


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
        self.view_blocks = _LiveTable()  # base -> a compressed view of it (NOTE [Aliased saves])
        self.shaped = _LiveTable()  # tensors saved as their shape (NOTE [Shape-only saves])
        self.boundaries = _LiveStorages()  # NOTE [Boundary saves], NOTE [Aliased saves]
        self.pending: collections.deque[SavedCompressed] = collections.deque()  # NOTE below
        self.unpacked = 0  # unpack calls so far: tells whether a closure ran a backward
        self.probing = False  # a ProbeSession is running its probes
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
        with _profiled("gact::pack"):  # a with block adds no frame: see _from_checkpoint
            if owner is None:
                return self.pack_own(tensor, inside=False)
            return owner.pack_own(tensor, inside=True, region_input=_from_checkpoint())

    def unpack(self, saved: Saved | object) -> torch.Tensor:
        if not isinstance(saved, Saved):  # AOTAutograd traces a compiled graph's unpack
            return compiled.unpack_traced(saved, compiled.tracing_context())
        self.unpacked += 1
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
        self.boundaries.clear()
        self._graphs_counted.clear()

    def traced(self, site: CompiledSite) -> None:
        """A compiled graph's save was traced with ``site``'s decision."""
        self.compiled_sites[site.key] = site
        self.compiled_graphs.add(site.graph)
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
            extra_bits=decisions.BATCH_NORM_EXTRA_BITS  # as _batch_norm's rule in eager code
            if site.batch_norm_input and decisions.small_channels(tensor)
            else 0,
            arguments=frozenset() if site.log_probabilities else None,  # stored as exp(tensor)
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
    def pack_own(self, tensor: torch.Tensor, *, inside: bool, region_input: bool = False) -> Saved:
        """Pack a save made in this controller's model (or, ``inside=False``, outside every
        controlled model: then it is kept as it is); ``region_input``: ``torch.utils.checkpoint``
        keeps ``tensor`` for a region it will recompute."""
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
        exact = region_input and not self.plan.config.compress_checkpoint_inputs
        if inside and self.tracker.compiled():  # eager code in a compiled forward
            self.on_compiled()
            exact = True  # see NOTE [Compiled forwards] in scope.py
        stored = hit.source if isinstance(hit, SavedView) else hit
        if isinstance(stored, SavedCompressed) and (
            stored.table is not None  # only the function's own backward reads a table
            or (stored.logged_by is not None and stored.logged_by is not spec)  # or log(p)
            or exact  # a compressed copy would not do,
            or (spec is not None and (spec.keeps(tensor) or spec.shapes(tensor)))
            # nor one with another call's width or groups (NOTE [Aliased saves]),
            or (stored is not hit and spec is not None and spec.predicates)
        ):  # nor decisions in another shape
            hit = None
        if hit is not None:
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
            self.ledger.record(key, tensor, Kind.RECOMPUTED, None, 0)
        elif kind is not None:
            saved = SavedKept(tensor, key)
            self._record_kept(key, tensor, kind)
        elif self._decisions_only(key, tensor, spec, compact, call):
            assert spec is not None
            saved = self._store_decisions(key, tensor, spec)
        else:
            saved = self._compress(key, tensor, compact, spec)
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
        self, key: str, tensor: torch.Tensor, spec: DecisionSpec
    ) -> SavedDecisions:
        """``tensor`` stored as the outcomes of ``spec``'s comparisons (NOTE [Decision-only
        saves]), and counted."""
        saved = SavedDecisions(tensor, key, spec, self.ledger.occurrences(key))
        assert saved.decision is not None
        self.ledger.record(key, tensor, Kind.DECISIONS, None, 0)
        self.ledger.add_decision(key, saved.decision.nbytes, len(saved.decision.predicates))
        return saved

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
            _address(tensor),
            tensor.storage_offset(),
            tensor.numel(),
            tensor.is_contiguous(),
        )
        if view:
            forward = self.tracker.generation
            if self.view_blocks.get(tensor._base, forward) is None:
                self.view_blocks.add(tensor._base, saved, forward)

    def _kept_parameter(self, tensor: torch.Tensor) -> SavedKept:
        """A save of a parameter or buffer: state, counted and kept as it is."""
        self.ledger.record(_PARAM_KEY, tensor, Kind.PARAMETER, None, 0)
        return SavedKept(tensor, _PARAM_KEY)

    def _measure(self, saved: Saved, tensor: torch.Tensor, spec: DecisionSpec | None) -> None:
        """Show the meter a save of ``tensor`` made during a call with ``spec`` (NOTE [Measured
        sensitivities] in measured.py): a quantized one or a derivative table, or one kept at
        full precision by an allocation, with a throwaway quantization of any part of it."""
        assert self.meter is not None

        # memory order or feature groups, as a quantized save of rank 2-3 (not a channel map's)
        def trial(part: torch.Tensor) -> gact_kernels.QuantizedTensor:
            seed, config = self.plan.seed_for("<trial>", 0), self.plan.config
            features = _feature_dim(part, config, self.plan.default_bits)
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

    def _record_kept(self, key: str, tensor: torch.Tensor, kind: Kind) -> None:
        """The ledger entry of a save stored as it is (its dtype's width if the allocation
        keeps its key at full precision)."""
        full = self.plan.config.spec.compresses and self.plan.bits_for(key) is None
        bits = tensor.element_size() * 8 if kind is Kind.KEPT and full else None
        self.ledger.record(key, tensor, kind, bits, None)

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
        if tensor.dtype is torch.bool or tensor.dtype in gact_kernels.INT_DTYPES:
            return None  # packed losslessly
        if tensor.dtype not in gact_kernels.FLOAT_DTYPES or self.plan.bits_for(key) is None:
            return Kind.KEPT
        if key in self.plan.exact_keys:
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
    ) -> Saved:
        """Compress ``tensor`` saved at ``key`` during a call with ``spec``; ``occurrence``
        and ``decision``: those of a save stored as its decisions alone until now (NOTE
        [Decision-only saves])."""
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
        if logged:  # NOTE [Log-probabilities] in decisions.py
            data = data.exp()
        if tensor.dtype is torch.bool:
            payload: gact_kernels.Compressed = gact_kernels.pack_mask(data)
            kind, bits = Kind.MASK, 1
        elif tensor.dtype in gact_kernels.INT_DTYPES:
            payload = gact_kernels.pack_ints(data, group_size=group_size)
            kind, bits = Kind.PACKED, None
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
                    decisions.small_map_bits(data, nominal),
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
                channels = plan.config.channel_groups and data.dim() >= 4
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
                    channel_dim = _feature_dim(data, plan.config, plan.default_bits)
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
        held = saved.known  # lossless groups of a pending one reach the ledger when resolved
        nbytes = held.nbytes
        quantized = isinstance(held, gact_kernels.QuantizedTensor)
        self.ledger.record(
            key, tensor, kind, bits, nbytes, zero_exact=zero_exact, table=candidate,
            metadata_bits=_metadata_bits(held, nbytes) if quantized else None,
            min_bits=floor if quantized else 0,
            preferred_bits=preferred if quantized else 0,
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
                feature_dim=_feature_dim(data, config, self.plan.default_bits),
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

    def missed_decision(self, key: str, node: str) -> None:
        """A compressed tensor reached a deciding backward node without exact masks (an
        operator whose Python entry point ``DecisionMode`` does not know): keep ``key`` exact
        from the next forward on."""
        self.plan.exact_keys.add(key)
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
    [Attention and row normalisations] in decisions.py), else ``None``."""
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
# [Attention and row normalisations] in decisions.py) and rotated saves (heavy tails, NOTE
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


def _feature_dim(data: torch.Tensor, config: GactConfig, width: int) -> int | None:
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
