"""Peak memory of a training window, on CUDA and on the CPU.

CUDA: ``torch.cuda.reset_peak_memory_stats`` at the start, ``max_memory_allocated`` at the end.
CPU: the peak resident set size of the process; on Linux the kernel's high-water mark is reset at
the start (``/proc/self/clear_refs``), so the peak covers the window only.
"""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path

import torch
from gact.ledger import live_tensor_peak

__all__ = ["MemoryMeter", "live_tensor_peak", "status_bytes", "tune_malloc_for_measurement"]


def tune_malloc_for_measurement() -> bool:
    """Make the resident size follow live memory (glibc only).

    Allocations of 128 KiB and more are served by ``mmap`` and freed heap memory is trimmed,
    instead of glibc's adaptive threshold that keeps freed tensor memory resident; without this,
    peak RSS reflects allocator retention more than live tensors. Call it before the first large
    allocation of the process.

    Returns:
        Whether both settings were applied (False off Linux or without glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 128 * 1024) == 1
        return ok and libc.mallopt(m_trim_threshold, 128 * 1024) == 1
    except (OSError, AttributeError):
        return False


def _proc_status_kb(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else None


def status_bytes(field: str) -> int:
    """A size from ``/proc/self/status`` in bytes, e.g. ``VmRSS`` or ``VmHWM`` (Linux only).

    Raises:
        RuntimeError: no such field (not Linux, or an unknown name).
    """
    kb = _proc_status_kb(field)
    if kb is None:
        raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")
    return kb * 1024


def _maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024  # Linux reports KiB


class MemoryMeter:
    """Peak memory over a window: ``start()`` ... ``stop()``, then ``peak`` and ``delta``.

    The baseline is what is in use at ``start()`` (``memory_allocated`` on CUDA, the resident
    size on the CPU); ``delta`` is ``peak - baseline``. Off Linux the CPU peak is the whole
    process's (``resource.getrusage``), which ``method`` says.

    Args:
        device: the device whose memory is measured.

    Example:
        >>> meter = MemoryMeter(torch.device("cpu"))
        >>> meter.start()
        >>> x = torch.ones(1 << 20)
        >>> meter.stop()
        >>> meter.peak >= meter.baseline > 0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0
        self.peak = 0
        self.reserved_peak: int | None = None  # CUDA: max_memory_reserved
        self.process_peak = 0
        self.method = ""
        self._window = False

    def start(self) -> None:
        """Reset the high-water mark and record the baseline."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.method = "cuda max_memory_allocated"
            return
        rss = _proc_status_kb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM (peak RSS) to the current RSS
            self._window = _proc_status_kb("VmHWM") is not None
        except OSError:
            self._window = False
        self.baseline = rss * 1024 if rss is not None else _maxrss_bytes()
        self.method = "cpu peak RSS (VmHWM window)" if self._window else "cpu peak RSS (getrusage)"

    def stop(self) -> None:
        """Read the peak since ``start()``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.reserved_peak = torch.cuda.max_memory_reserved(self.device)
            self.process_peak = self.peak
            return
        self.process_peak = _maxrss_bytes()
        hwm = _proc_status_kb("VmHWM") if self._window else None
        self.peak = hwm * 1024 if hwm is not None else self.process_peak

    @property
    def delta(self) -> int:
        """Peak over the baseline, in bytes (never negative)."""
        return max(0, self.peak - self.baseline)
