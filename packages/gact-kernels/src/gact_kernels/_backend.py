"""Which compiled kernels exist: :func:`compiled_with_cuda` and :class:`CUDANotCompiledError`."""

from __future__ import annotations

from typing import Any

import torch

from . import _cpu

try:
    from . import _cuda
except ImportError:  # built without a CUDA compiler, or with GACT_KERNELS_CUDA=OFF
    _cuda = None

__all__ = [
    "DTYPE_CODES",
    "CUDANotCompiledError",
    "compiled_with_cuda",
    "current_stream",
    "launch",
    "require_device",
]

# The compiled modules take integers only (addresses, sizes, a device index and a
# ``cudaStream_t``); this module is the single place that turns torch objects into them.

#: dtype -> code understood by the kernels (``enum DType`` in ``csrc/common.h``).
DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.uint8: 3,
    torch.int8: 4,
    torch.int16: 5,
    torch.int32: 6,
    torch.int64: 7,
}

_REBUILD_HINT = (
    "this gact-kernels build has no CUDA module. Reinstall it with nvcc on PATH, e.g. "
    "`SKBUILD_CMAKE_DEFINE=GACT_KERNELS_CUDA=ON pip install --no-binary gact-kernels "
    "gact-kernels` (or `pip install ./packages/gact-kernels` from a source checkout)"
)


class CUDANotCompiledError(RuntimeError):
    """A CUDA tensor reached a gact-kernels build that has no CUDA module."""


def compiled_with_cuda() -> bool:
    """Whether the CUDA module ``gact_kernels._cuda`` was built and imports.

    Example:
        >>> import gact_kernels
        >>> isinstance(gact_kernels.compiled_with_cuda(), bool)
        True
    """
    return _cuda is not None


def require_device(device: torch.device, name: str) -> None:
    """Raises unless kernels exist for ``device`` (``name`` is the argument it came from).

    Raises:
        ValueError: ``device`` is neither ``cpu`` nor ``cuda``.
        CUDANotCompiledError: ``device`` is ``cuda`` and the CUDA module was not built.
    """
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(f"{name}: device {device} is not supported; accepted devices: cpu, cuda")
    if _cuda is None:
        raise CUDANotCompiledError(f"{name} is on {device} but {_REBUILD_HINT}")


def launch(kernel: str, device: torch.device, *args: int) -> Any:
    """Calls ``kernel`` of the module for ``device`` with ``args`` plus the device arguments.

    CPU kernels get ``torch.get_num_threads()`` threads (so ``torch.set_num_threads`` applies);
    CUDA kernels are enqueued on ``torch.cuda.current_stream(device)`` without synchronising.
    """
    if device.type == "cpu":
        return getattr(_cpu, kernel)(*args, torch.get_num_threads())
    require_device(device, "tensor")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return getattr(_cuda, kernel)(*args, index, _current_raw_stream(index))


_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)``, the same object while the same stream is current
    (building one costs more than a small kernel launch)."""
    key = (index, _current_raw_stream(index))
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) >= 64:  # many streams came and went: start over
            _streams.clear()
        stream = _streams[key] = torch.cuda.current_stream(index)
    return stream


def _current_raw_stream(index: int) -> int:
    """The ``cudaStream_t`` of ``torch.cuda.current_stream(index)``, without building a
    ``Stream`` object when this torch has the raw accessor (its CUDA builds do)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(index)
    return torch.cuda.current_stream(index).cuda_stream
