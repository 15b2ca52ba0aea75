"""Level L3: compressed payloads wait for backward in pinned CPU memory.

# NOTE [Swap streams]
# Offload: a side CUDA stream waits for the compute stream, copies the payload into pinned host
# memory (torch's caching host allocator is the reusable pinned pool), and the device buffers are
# marked as used by the side stream (``record_stream``) so the allocator reuses them only after
# the copy; the device copy is then dropped. Fetch: the payload needed now is copied back on the
# side stream and the compute stream waits for it; at the same time the payload saved just
# before it (the next one backward will need, as backward runs in reverse order) is prefetched.
# Payloads on the CPU (CPU-only training) are left where they are: L3 then behaves as L2, and a
# warning says so once.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Union

import gact_kernels
import torch

if TYPE_CHECKING:
    from .saved import Saved

__all__ = ["Swapper"]

logger = logging.getLogger("gact")
# What a ``Saved`` owns: the two compressed containers of gact_kernels.
Payload = Union[gact_kernels.QuantizedTensor, gact_kernels.PackedMask]


class _Ticket:
    __slots__ = ("consumed", "device", "event", "index", "order", "prefetched")

    def __init__(self, device: torch.device, order: list[weakref.ref]) -> None:
        self.device = device
        self.order = order  # the save order of this ticket's step
        self.index = len(order)
        self.event: torch.cuda.Event | None = None
        self.prefetched: Payload | None = None
        self.consumed = False  # fetched once: never prefetched again (retain_graph, reuse)


class Swapper:
    """Moves payloads of ``Saved`` objects to pinned host memory and back."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._order: list[weakref.ref] = []
        self._warned = False

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def new_step(self) -> None:
        """Start a new save order (payloads of earlier steps keep theirs)."""
        self._order = []

    def offload(self, saved: Saved) -> _Ticket | None:
        payload = saved.payload
        if payload.device.type != "cuda":
            if not self._warned:
                logger.warning(
                    "GACT level L3 swaps to pinned memory on CUDA only; on %s it behaves as L2",
                    payload.device,
                )
                self._warned = True
            return None
        device = payload.device
        side = self._stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            host = payload.to("cpu", non_blocking=True)
        for buf in payload.buffers():
            buf.record_stream(side)
        ticket = _Ticket(device, self._order)
        saved.payload = host
        self._order.append(weakref.ref(saved))
        return ticket

    def fetch(self, saved: Saved) -> Payload:
        ticket = saved.ticket
        if ticket is None:
            return saved.payload
        current = torch.cuda.current_stream(ticket.device)
        payload = ticket.prefetched
        if payload is None:
            payload = self._copy_in(saved, ticket)
        ticket.prefetched = None
        ticket.consumed = True
        assert ticket.event is not None
        current.wait_event(ticket.event)
        for buf in payload.buffers():
            buf.record_stream(current)
        self._prefetch_before(ticket)
        return payload

    def _copy_in(self, saved: Saved, ticket: _Ticket) -> Payload:
        side = self._stream(ticket.device)
        with torch.cuda.stream(side):
            payload = saved.payload.to(ticket.device, non_blocking=True)
            ticket.event = side.record_event()
        return payload

    def _prefetch_before(self, ticket: _Ticket) -> None:
        for i in range(ticket.index - 1, -1, -1):
            owner = ticket.order[i]()
            if owner is None or owner.ticket is None or owner.ticket.consumed:
                continue
            if owner.ticket.prefetched is None:
                owner.ticket.prefetched = self._copy_in(owner, owner.ticket)
            return
