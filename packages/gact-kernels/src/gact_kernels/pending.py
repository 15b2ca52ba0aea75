"""A quantization whose lossless groups are not known yet: :class:`PendingQuantize`."""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

import torch

from . import _backend

if TYPE_CHECKING:
    from .quantize import QuantizedTensor

__all__ = ["PendingQuantize"]

# NOTE [Deferred lossless check]
# A group holding NaN/Inf (or whose step would be subnormal) is stored losslessly: its raw
# elements are copied out of the input. Which groups those are is known only once the kernel
# has run; on the CPU it returns their count, but on CUDA reading anything back synchronises
# the host with the device, and a training step makes hundreds of saves: one synchronisation
# each keeps the host from queueing work ahead of the GPU, so every microsecond of Python
# around a save adds to the step. So on CUDA the kernel reports through a byte of page-locked
# host memory instead (``csrc/kernels.h``): the launch sets it to 0, the kernel sets it to 1
# if it stores any group losslessly, and an event recorded after the launch tells when the
# byte is final. Until then the input is held (the lossless elements may still be needed);
# once the event has passed, a 0 proves there is no lossless group (the common case: the
# input is released, nothing is copied) and a 1 sends the call down the synchronous path
# (``isnan(scale).nonzero()``, then the gather).
# The bytes come from one ring of slots, shared by all devices. A slot is reused after
# ``_SLOTS`` later calls, which zero it at their launch: a pending call whose slot was taken
# since (its ``ticket`` no longer owns the slot) cannot trust the byte and takes the
# synchronous path.
# A stale kernel can only set a byte to 1, never clear one: a 1 may be a false alarm (the
# synchronous path then finds no group), a 0 is never wrong.
_SLOTS = 4096


class _FlagRing:
    """The page-locked flag bytes of the quantize calls (NOTE [Deferred lossless check]); under
    unified addressing every device writes them at their host address."""

    def __init__(self) -> None:
        self.flags = torch.zeros(_SLOTS, dtype=torch.uint8, pin_memory=True)
        self.view = self.flags.numpy()  # reads without a tensor op
        self.address = self.flags.data_ptr()
        self.owners = [-1] * _SLOTS
        self._tickets = itertools.count()
        # else (pinned memory the device cannot address at its host address) synchronise
        self.usable = bool(_backend._cuda.device_addressable(self.address))

    def take(self) -> tuple[int, int]:
        """A slot and the ticket that owns it until ``_SLOTS`` more are taken."""
        ticket = next(self._tickets)
        slot = ticket % _SLOTS
        self.owners[slot] = ticket
        return slot, ticket


_ring: _FlagRing | None = None
_ring_lock = threading.Lock()


def flag_ring() -> _FlagRing:
    """The flag ring that every CUDA device's quantize calls share, created on first use."""
    global _ring
    if _ring is None:
        with _ring_lock:
            if _ring is None:
                _ring = _FlagRing()
    return _ring


def element_index(groups: torch.Tensor, group_size: int, numel: int) -> torch.Tensor:
    """Flat indices of the elements of ``groups``, (len(groups), group_size), clamped in range."""
    offsets = torch.arange(group_size, device=groups.device)
    return (groups[:, None] * group_size + offsets).clamp_(0, max(numel - 1, 0))


def lossless_groups(
    flat: torch.Tensor, scale: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices and raw elements of the groups flagged by a NaN scale in ``flat`` (the
    quantized block in memory order: 1-D, or contiguous); on CUDA the ``nonzero`` synchronises."""
    flat = flat.view(-1)
    groups = torch.isnan(scale).nonzero().flatten()
    return groups, flat[element_index(groups, group_size, flat.numel())]


class PendingQuantize:
    """The result of :func:`~gact_kernels.quantize_async`: a
    :class:`~gact_kernels.QuantizedTensor` that may still wait for its kernel to tell whether
    it stores a group losslessly (NOTE [Deferred lossless check] in pending.py).

    ``provisional`` is the container as it is when no group is lossless: its metadata
    (``shape``, ``bits``, ``zero_exact``, ``stored_numel``...) are final, its ``nbytes`` a lower
    bound. Until it is resolved the pending call holds the input, as ``quantize`` would while it
    runs; :meth:`done` never blocks, :meth:`result` at most until the kernel has run. On the
    CPU it is resolved from the start.

    Example:
        >>> import torch, gact_kernels
        >>> x = torch.randn(1000)
        >>> p = gact_kernels.quantize_async(x, 4, seed=1)  # on CUDA: no synchronisation
        >>> p.done(), p.result() == gact_kernels.quantize(x, 4, seed=1)
        (True, True)
    """

    __slots__ = ("_event", "_result", "_ring", "_slot", "_source", "_ticket", "provisional")

    def __init__(
        self,
        provisional: QuantizedTensor,
        source: torch.Tensor | None = None,
        event: torch.cuda.Event | None = None,
        ring: _FlagRing | None = None,
        slot: tuple[int, int] = (0, -1),
    ) -> None:
        self.provisional = provisional
        self._source = source  # the block the kernel read; None once resolved
        self._event = event
        self._ring = ring
        self._slot, self._ticket = slot
        self._result: QuantizedTensor | None = provisional if source is None else None

    def done(self) -> bool:
        """Whether :meth:`result` returns without waiting for the device; never blocks."""
        return self._result is not None or self._event is None or self._event.query()

    def result(self) -> QuantizedTensor:
        """The container, once the kernel has run (waits for it if needed); the same object
        on every call."""
        if self._result is None:
            self._resolve()
        assert self._result is not None
        return self._result

    def _resolve(self) -> None:
        q, source = self.provisional, self._source
        assert source is not None
        if self._event is not None and not self._event.query():
            self._event.synchronize()  # a real wait: the device has not got there yet
        ring = self._ring
        clear = (
            ring is not None
            and ring.owners[self._slot] == self._ticket
            and ring.view[self._slot] == 0
        )
        if not clear:  # a lossless group (or a slot reused since): the synchronous path
            groups, values = lossless_groups(source, q.scale, q.group_size)
            if groups.numel():
                q = q._with(lossless_groups=groups, lossless_values=values)
        self._result, self._source, self._event = q, None, None

    def __repr__(self) -> str:
        state = "resolved" if self._result is not None else "pending"
        return f"PendingQuantize({state}, {self.provisional!r})"
