"""The common base of the compressed containers, and :func:`decompress`."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, TypeVar

import torch

__all__ = ["Compressed", "decompress"]

C = TypeVar("C", bound="Compressed")

# NOTE [container invariants]
# A container's fields are validated against each other whenever one is built from outside:
# by hand, by ``dataclasses.replace``, ``.to()``, ``copy``, ``pickle`` or ``torch.load`` (all
# of them go through ``__init__``; ``__reduce__`` sends unpickling there too). The compressing
# functions of this package build theirs with ``_built``, which skips that check: they
# allocate every buffer to the shape the metadata implies, so the check could only re-derive
# their own arithmetic, and it costs a few microseconds per call (a transformer step makes
# hundreds); tests/test_containers.py validates every container they return. The checks read
# metadata only (dtype, shape, device, contiguity), never tensor values: a container may be
# built around buffers whose asynchronous copy is still in flight. The
# buffers themselves stay mutable tensors, so the restoring function re-checks the shapes of
# those whose addresses reach the kernels before every call (a quantized container's lossless
# buffers, read by torch indexing alone, only where there are lossless groups), and the kernels
# never read or write out of bounds whatever the values (lossless group indices are clamped,
# integer widths bounded).


def _move(t: torch.Tensor, device: torch.device, non_blocking: bool, pin: bool) -> torch.Tensor:
    if not pin:
        return t.to(device, non_blocking=non_blocking)
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return out.copy_(t, non_blocking=non_blocking)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    # Bitwise, so that NaN scales and NaN payloads compare equal to themselves.
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# per container class: field name -> its slot's setter (``Compressed._built``)
_SETTERS: dict[type, dict[str, Any]] = {}


class Compressed(abc.ABC):
    """A compressed tensor produced by gact_kernels; :func:`decompress` restores any of them.

    The concrete containers are frozen dataclasses (:class:`~gact_kernels.QuantizedTensor`,
    :class:`~gact_kernels.PackedMask`, :class:`~gact_kernels.PackedInts`) that hold torch
    tensors on one device. They can be copied, deep-copied, pickled and saved with
    ``torch.save`` (``torch.load`` accepts them with ``weights_only=True``); two containers
    are equal when all their fields are, buffers compared bit for bit.

    Example:
        >>> import copy, torch, gact_kernels
        >>> c = gact_kernels.quantize(torch.randn(1000), 4, seed=3)
        >>> isinstance(c, gact_kernels.Compressed), copy.deepcopy(c) == c
        (True, True)
    """

    __slots__ = ()
    _BUFFERS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def _built(cls: type[C], **fields: Any) -> C:
        """A container from this package's compressing functions, whose buffers were allocated
        to the shapes the metadata implies: not re-validated (NOTE [container invariants]).
        Every field must be given."""
        setters = _SETTERS.get(cls)
        if setters is None:  # the slots' own setters: a frozen dataclass refuses setattr
            setters = _SETTERS[cls] = {
                f.name: getattr(cls, f.name).__set__ for f in dataclasses.fields(cls)
            }
        obj = object.__new__(cls)
        for name, value in fields.items():
            setters[name](obj, value)
        return obj

    def _with(self: C, **changes: Any) -> C:
        """A copy with ``changes``, from this package's functions (not re-validated)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return self._built(**{**fields, **changes})

    @abc.abstractmethod
    def _validate(self) -> None:
        """Raises TypeError/ValueError naming the first inconsistent field."""

    @abc.abstractmethod
    def _decompress(self) -> torch.Tensor:
        """The original tensor (see ``decompress``)."""

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor held, e.g. for ``Tensor.record_stream`` after an asynchronous copy."""
        return tuple(getattr(self, name) for name in self._BUFFERS)

    @property
    def device(self) -> torch.device:
        """Device of the stored buffers (all buffers share it)."""
        return getattr(self, self._BUFFERS[0]).device

    @property
    def nbytes(self) -> int:
        """Total bytes of all tensors held (payload, metadata and side buffers)."""
        return sum([getattr(self, name).nbytes for name in self._BUFFERS])

    def to(
        self: C,
        device: torch.device | str,
        *,
        non_blocking: bool = False,
        pin_memory: bool = False,
    ) -> C:
        """Returns a copy with every buffer on ``device``.

        Args:
            device: target device, e.g. ``"cpu"`` or ``"cuda:0"``.
            non_blocking: asynchronous copy on the current stream, as ``Tensor.to``. A
                CUDA -> CPU copy with ``non_blocking=True`` lands in pinned memory (torch
                allocates it pinned); keep the source alive until the stream passes the copy.
            pin_memory: place the CPU copy in page-locked memory (``device`` must be ``cpu``
                and torch must see an accelerator).

        Example:
            >>> import torch, gact_kernels
            >>> q = gact_kernels.quantize(torch.randn(1000), 4)
            >>> q.to("cpu").device.type
            'cpu'
        """
        device = torch.device(device)
        if pin_memory and device.type != "cpu":
            raise ValueError(f"pin_memory=True needs device='cpu', got device={device}")
        moved = {
            name: _move(getattr(self, name), device, non_blocking, pin_memory)
            for name in self._BUFFERS
        }
        return dataclasses.replace(self, **moved)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # Frozen slotted dataclasses cannot be rebuilt attribute by attribute; rebuilding
        # through __init__ also re-validates (NOTE [container invariants]).
        return type(self), self._values()

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for a, b in zip(self._values(), other._values()):
            same = _same_bits(a, b) if isinstance(a, torch.Tensor) else a == b
            if not same:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # equality is by value, buffers are mutable

    def __repr__(self) -> str:
        meta = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name not in self._BUFFERS
        )
        return f"{type(self).__name__}({meta}, device={self.device}, nbytes={self.nbytes})"


def decompress(c: Compressed) -> torch.Tensor:
    """Restores any container of gact_kernels: quantised, mask or integer pack.

    Equivalent to :func:`~gact_kernels.dequantize`, :func:`~gact_kernels.unpack_mask` or
    :func:`~gact_kernels.unpack_ints`, chosen by the type of ``c``.

    Args:
        c: a :class:`Compressed` container (possibly moved with ``c.to(...)``).

    Returns:
        A new tensor with the original shape, strides (see ``quantize``), dtype and device.

    Example:
        >>> import torch, gact_kernels
        >>> m = torch.rand(4, 5) > 0.5
        >>> torch.equal(gact_kernels.decompress(gact_kernels.pack_mask(m)), m)
        True
    """
    if not isinstance(c, Compressed):
        raise TypeError(
            f"c must be a gact_kernels.Compressed container (QuantizedTensor, PackedMask or "
            f"PackedInts), got {type(c).__name__}"
        )
    return c._decompress()
