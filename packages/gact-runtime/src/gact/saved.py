"""What ``pack`` returns for each save, and so what autograd holds: the tensor itself, its
compressed payload, its shape, the outcomes of its comparisons, another save's payload seen
through a view, or a recomputed activation's input."""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import gact_kernels
import torch

from . import decisions, pointwise, rotation
from .decision_spec import DecisionSpec
from .decisions import DECISION_NODES, Decision
from .errors import GactError
from .live import storage_address
from .recomputed import ActivationCall
from .swap import Ticket

if TYPE_CHECKING:
    from .hooks import SaveHooks

__all__ = [
    "Saved", "SavedCompressed", "SavedDecisions", "SavedKept", "SavedRecomputed", "SavedShape",
    "SavedView",
]  # fmt: skip

# NOTE [What autograd holds]
# ``pack`` returns a ``Saved``: ``SavedKept`` holds the tensor itself (parameters, buffers, small,
# integer or float64 tensors, level L0, keys kept at full precision, saves outside the model's
# forward); ``SavedCompressed`` owns the compressed payload; ``SavedShape`` holds a shape alone
# (NOTE [Shape-only saves] in decision_rules.py); ``SavedDecisions`` the outcomes of comparisons
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


def _describe(dtype: torch.dtype, device: torch.device, shape: Sequence[int]) -> str:
    """``[torch.FloatTensor [16, 256]]``, as PyTorch names tensors in its messages."""
    name = torch.empty((), dtype=dtype).type().replace("torch.", f"torch.{device.type}.")
    return f"[{name.replace('torch.cpu.', 'torch.')} [{', '.join(map(str, shape))}]]"


class Saved(abc.ABC):
    """What autograd holds for one saved tensor; ``unpack`` gives the tensor back."""

    __slots__ = ("__weakref__", "key", "node", "output_nr", "owner", "version")

    def __init__(self, tensor: torch.Tensor, key: str) -> None:
        self.key = key
        # the hooks of the controller whose model's forward saved it, which count its unpacks
        # (NOTE [Backwards seen] in backwards.py); ``None`` outside every controlled forward
        self.owner: SaveHooks | None = None
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
    [Shape-only saves] in decision_rules.py). Unpacks to one NaN expanded to that shape."""

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
# saves] in decision_rules.py; a ReLU before dropout) that is 1 bit per element instead of the
# level's width and group headers (4 zero-exact bits and more at L1), and the tensor is no item of
# the allocation. Usually a later call saves the same tensor for its values (the next convolution):
# that save compresses it then, as its first save would have been compressed (same key, occurrence,
# seed and spec; the decisions the first call's backward consumes, less the mask the zero-exact grid
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
        "decision", "expand_to", "factor_read", "hooks", "logged_by", "payload", "rotated",
        "shaped_by", "span", "table", "ticket", "view_to", "witness",
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
        # in decision_rules.py): unpacked as their log, shared with that call's saves alone
        self.logged_by: DecisionSpec | None = None
        # the call that gave it a width or groups of its own (``DecisionSpec.shapes``): its other
        # saves of the tensor share it (NOTE [Aliased saves])
        self.shaped_by: DecisionSpec | None = None
        # a product reads it into another factor's gradient (NOTE [Products of a shared save])
        self.factor_read = False
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
            storage_address(tensor) != storage  # ``.data`` swapped since
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
