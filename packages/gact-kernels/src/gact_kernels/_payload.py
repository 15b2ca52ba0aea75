"""Behaviour shared by the compressed containers: size accounting and device moves."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, TypeVar

import torch

__all__ = ["Payload"]

P = TypeVar("P", bound="Payload")


def _move(t: torch.Tensor, device: torch.device, non_blocking: bool, pin: bool) -> torch.Tensor:
    if not pin:
        return t.to(device, non_blocking=non_blocking)
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    return out.copy_(t, non_blocking=non_blocking)


class Payload:
    """Mixin for frozen dataclasses whose tensor fields are listed in ``_BUFFERS``."""

    __slots__ = ()
    _BUFFERS: ClassVar[tuple[str, ...]]

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor held, e.g. for ``Tensor.record_stream`` after an asynchronous copy."""
        return tuple(getattr(self, name) for name in self._BUFFERS)

    @property
    def device(self) -> torch.device:
        """Device of the stored buffers (all buffers share it)."""
        return self.buffers()[0].device

    @property
    def nbytes(self) -> int:
        """Total bytes of all tensors held (payload, metadata and side buffers)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def to(
        self: P,
        device: torch.device | str,
        *,
        non_blocking: bool = False,
        pin_memory: bool = False,
    ) -> P:
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
