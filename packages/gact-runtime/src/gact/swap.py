"""Level L3: compressed payloads wait for backward in pinned CPU memory."""

from __future__ import annotations

import logging
import weakref

import gact_kernels
import torch

__all__ = ["Swapper", "Ticket"]

logger = logging.getLogger("gact")

# NOTE [Swap streams]
# Offload: a side CUDA stream waits for the compute stream, copies the payload into pinned host
# memory (torch's caching host allocator is the reusable pinned pool), and the device buffers are
# marked as used by the side stream (``record_stream``) so the allocator reuses them only after
# the copy; the device copy is then dropped. Fetch: the payload needed now is copied back on the
# side stream and the compute stream waits for it; at the same time the payload offloaded just
# before it (the next one backward will need, as backward runs in reverse order) is prefetched.
# Payloads on the CPU (CPU-only training) are not offloaded: L3 then behaves as L2, and a warning
# says so once. The owner of a payload only holds its ``Ticket``; the ticket owns the host copy.


class Ticket:
    """A payload waiting in pinned host memory, as handed out by ``Swapper.offload``."""

    __slots__ = (
        "__weakref__",
        "consumed",
        "device",
        "event",
        "index",
        "order",
        "payload",
        "prefetched",
    )

    def __init__(
        self, payload: gact_kernels.Compressed, device: torch.device, order: list[weakref.ref]
    ) -> None:
        self.payload = payload  # the host copy
        self.device = device
        self.order = order  # the offload order of this ticket's step
        self.index = len(order)
        self.event: torch.cuda.Event | None = None
        self.prefetched: gact_kernels.Compressed | None = None
        self.consumed = False  # fetched once: never prefetched again (retain_graph, reuse)


class Swapper:
    """Moves payloads to pinned host memory and back (see NOTE [Swap streams])."""

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
        """Start a new offload order (tickets of earlier steps keep theirs)."""
        self._order = []

    def offload(self, payload: gact_kernels.Compressed) -> Ticket | None:
        """Start copying ``payload`` to the host; ``None`` if it stays where it is (CPU)."""
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
        ticket = Ticket(host, device, self._order)
        self._order.append(weakref.ref(ticket))
        return ticket

    def fetch(self, ticket: Ticket) -> gact_kernels.Compressed:
        """The payload of ``ticket`` on its device, ready on the current stream."""
        current = torch.cuda.current_stream(ticket.device)
        payload = ticket.prefetched
        if payload is None:
            payload = self._copy_in(ticket)
        ticket.prefetched = None
        ticket.consumed = True
        assert ticket.event is not None
        current.wait_event(ticket.event)
        for buf in payload.buffers():
            buf.record_stream(current)
        self._prefetch_before(ticket)
        return payload

    def _copy_in(self, ticket: Ticket) -> gact_kernels.Compressed:
        side = self._stream(ticket.device)
        with torch.cuda.stream(side):
            payload = ticket.payload.to(ticket.device, non_blocking=True)
            ticket.event = side.record_event()
        return payload

    def _prefetch_before(self, ticket: Ticket) -> None:
        for i in range(ticket.index - 1, -1, -1):
            earlier = ticket.order[i]()
            if earlier is None or earlier.consumed:
                continue
            if earlier.prefetched is None:
                earlier.prefetched = self._copy_in(earlier)
            return
