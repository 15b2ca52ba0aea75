"""Training-loop helpers shared by every example script.

The pieces, in the order a script uses them:

* :func:`base_parser` - the common command line (``--data --epochs --seed --device --gact --level
  --get-mem --json ...``);
* :func:`setup` - seeds, device, thread count;
* :class:`Run` - owns the optional GACT :class:`~gact.Controller`, times every step, measures peak
  memory and collects ``controller.stats()``; ``run.step(closure)`` is the one call per iteration;
* :meth:`Run.result` / :func:`write_json` / :func:`print_summary` - the JSON record and the
  one-screen summary at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gact
import numpy as np
import torch

from common.data import default_data_root

LEVELS = tuple(gact.LEVELS)
STAT_KEYS = ("original_bytes", "stored_bytes", "compressed_tensors", "skipped_tensors")
# Every JSON record carries at least these keys (the bench and the tests rely on them).
REQUIRED_KEYS = (
    "model",
    "dataset",
    "level",
    "epochs",
    "seed",
    "metric",
    "final_metric",
    "original_bytes",
    "stored_bytes",
    "compression_ratio",
    "peak_memory_bytes",
    "step_time_s",
    "throughput",
)


# --------------------------------------------------------------------------------------------
# command line


def base_parser(description: str, *, epochs: int, batch_size: int | None = None):
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--data",
        default=default_data_root(),
        help="dataset directory, or the parent of all datasets (default: $GACT_DATA)",
    )
    p.add_argument("--epochs", type=int, default=epochs)
    if batch_size is not None:
        p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default per model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gact", action="store_true", help="train with GACT (see --level)")
    p.add_argument("--level", default="L2", choices=LEVELS, help="GACT optimisation level")
    p.add_argument(
        "--adapt-interval",
        type=int,
        default=None,
        help="steps between sensitivity probes at adaptive levels (default: the library's)",
    )
    p.add_argument(
        "--get-mem",
        action="store_true",
        help="memory run: train --mem-steps steps only, print the memory breakdown, no eval",
    )
    p.add_argument("--mem-steps", type=int, default=5)
    p.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p


def tune_malloc_for_measurement() -> bool:
    """Make the CPU's resident size track live memory (glibc only): serve allocations of 128 KiB
    and more with mmap and trim freed heap memory, instead of glibc's adaptive threshold that
    keeps freed tensor memory resident. Without it peak RSS reflects allocator retention more
    than live tensors. Returns whether it was applied."""
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


def setup(args: argparse.Namespace) -> torch.device:
    """Seed every RNG, pick the device, set threads. Returns the device.

    Memory runs (``--get-mem``) on CPU also tune glibc malloc, see
    :func:`tune_malloc_for_measurement`.
    """
    if args.data is None:
        raise SystemExit("no data directory: pass --data DIR or set GACT_DATA")
    args.malloc_tuned = False
    if args.get_mem and args.device != "cuda":
        args.malloc_tuned = tune_malloc_for_measurement()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    return device


def progress(iterable: Iterable, args: argparse.Namespace, **kw):
    """tqdm over ``iterable`` unless --no-progress (or stderr is not a terminal)."""
    from tqdm.auto import tqdm

    disable = getattr(args, "no_progress", False) or not sys.stderr.isatty()
    return tqdm(iterable, disable=disable, dynamic_ncols=True, leave=False, **kw)


# --------------------------------------------------------------------------------------------
# memory


def _proc_status_kb(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else None


def _maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024  # Linux reports KiB


class MemoryMeter:
    """Peak memory over a window (``start()`` ... ``stop()``).

    CUDA: ``reset_peak_memory_stats`` then ``max_memory_allocated``; baseline is
    ``memory_allocated`` at start. CPU: peak resident set size of the process. On Linux the
    kernel's high-water mark is reset at ``start()`` (``/proc/self/clear_refs``) so the peak
    covers the window only; elsewhere ``resource.getrusage`` (whole-process peak) is used. The
    baseline is the resident size at ``start()``; ``delta`` = peak - baseline.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = 0
        self.peak = 0
        self.process_peak = 0
        self.method = ""
        self._window = False

    def start(self) -> None:
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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.process_peak = self.peak
            return
        self.process_peak = _maxrss_bytes()
        hwm = _proc_status_kb("VmHWM") if self._window else None
        self.peak = hwm * 1024 if hwm is not None else self.process_peak

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.baseline)


# --------------------------------------------------------------------------------------------
# the run


def make_controller(model: torch.nn.Module, args: argparse.Namespace):
    """A GACT controller for ``model`` at ``args.level`` (hook installed), or None without --gact."""
    if not args.gact:
        return None
    from gact import Controller, GactConfig

    options = {}
    if args.adapt_interval is not None:
        options["adapt_interval"] = args.adapt_interval
    cfg = GactConfig.from_level(args.level, **options)
    controller = Controller(model, config=cfg)
    controller.install_hook()
    return controller


class Run:
    """Bookkeeping for one training run: controller, step timing, activation stats, memory."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, device: torch.device):
        self.args = args
        self.device = device
        self.model = model
        self.controller = make_controller(model, args)
        self.memory = MemoryMeter(device)
        self.step_times: list[float] = []
        self.items = 0
        self.stats: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.n_params = sum(p.numel() for p in model.parameters())
        self._t0 = 0.0
        self.train_time = 0.0

    @property
    def level(self) -> str:
        return self.args.level if self.args.gact else "fp32"

    def __enter__(self) -> Run:
        self.memory.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.train_time = time.perf_counter() - self._t0
        self.memory.stop()
        if self.controller is not None:
            self.controller.uninstall_hook()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, closure: Callable[[], torch.Tensor], items: int) -> torch.Tensor:
        """One training iteration (forward + backward inside ``closure``), timed.

        With GACT the closure goes through ``controller.iterate`` so adaptive levels can run
        their sensitivity probes; the caller does ``optimizer.step()`` afterwards.
        """
        self._sync()
        t = time.perf_counter()
        if self.controller is not None:
            loss = self.controller.iterate(closure)
            st = self.controller.stats()
            if st:
                self.stats = dict(st)
        else:
            loss = closure()
        self._sync()
        self.step_times.append(time.perf_counter() - t)
        self.items += items
        return loss.detach() if isinstance(loss, torch.Tensor) else loss

    def log_epoch(self, **values: Any) -> None:
        self.history.append(values)

    def result(
        self,
        *,
        model: str,
        dataset: str,
        metric: str,
        final_metric: float | None,
        item_unit: str,
        items_per_step: float,
        **extra: Any,
    ) -> dict[str, Any]:
        # The first steps include warm-up (allocator, and the first sensitivity probe at adaptive
        # levels); the median over all steps ignores them.
        step_time = statistics.median(self.step_times) if self.step_times else math.nan
        orig = self.stats.get("original_bytes")
        stored = self.stats.get("stored_bytes")
        ratio = (orig / stored) if orig and stored else None
        rec: dict[str, Any] = {
            "model": model,
            "dataset": dataset,
            "level": self.level,
            "epochs": self.args.epochs,
            "seed": self.args.seed,
            "metric": metric,
            "final_metric": final_metric,
            "original_bytes": orig,
            "stored_bytes": stored,
            "compression_ratio": ratio,
            "peak_memory_bytes": self.memory.peak,
            "peak_memory_delta_bytes": self.memory.delta,
            "baseline_memory_bytes": self.memory.baseline,
            "process_peak_memory_bytes": self.memory.process_peak,
            "memory_method": self.memory.method
            + (" + glibc mmap threshold 128 KiB" if getattr(self.args, "malloc_tuned", 0) else ""),
            "step_time_s": step_time,
            "step_time_mean_s": statistics.fmean(self.step_times) if self.step_times else None,
            "steps": len(self.step_times),
            "throughput": items_per_step / step_time if step_time and step_time > 0 else None,
            "throughput_unit": f"{item_unit}/s",
            "train_time_s": self.train_time,
            "compressed_tensors": self.stats.get("compressed_tensors"),
            "skipped_tensors": self.stats.get("skipped_tensors"),
            "get_mem": bool(self.args.get_mem),
            "n_params": self.n_params,
            "device": str(self.device),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "argv": list(sys.argv),
            "history": self.history,
        }
        rec.update(extra)
        return rec

    def report(self) -> str | None:
        return self.controller.report() if self.controller is not None else None


def write_json(path: str | os.PathLike | None, record: dict[str, Any]) -> None:
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(o: Any):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# --------------------------------------------------------------------------------------------
# formatting


def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def finish(args: argparse.Namespace, run: Run, rec: dict[str, Any]) -> dict[str, Any]:
    """The end of every script: the per-tensor report (--get-mem), the JSON, the summary."""
    if args.get_mem and run.report():
        print(run.report())
    write_json(args.json, rec)
    print_summary(rec)
    return rec


def print_summary(rec: dict[str, Any], file=None) -> None:
    """The one-screen summary every script ends with."""
    file = file or sys.stdout
    fm = rec.get("final_metric")
    ratio = rec.get("compression_ratio")
    thr = rec.get("throughput")
    rows = [
        ("model / dataset", f"{rec['model']} / {rec['dataset']}"),
        ("level", f"{rec['level']}  (device {rec.get('device')}, {rec.get('threads')} threads)"),
        ("epochs / seed", f"{rec['epochs']} / {rec['seed']}"),
        (rec["metric"], "n/a (memory run)" if fm is None else f"{fm:.4f}"),
        (
            "saved activations",
            f"{fmt_bytes(rec['original_bytes'])} -> {fmt_bytes(rec['stored_bytes'])} per step",
        ),
        ("compression ratio", "n/a" if ratio is None else f"{ratio:.2f}x"),
        (
            "tensors compressed/kept",
            f"{rec.get('compressed_tensors')} / {rec.get('skipped_tensors')}",
        ),
        (
            "peak memory",
            f"{fmt_bytes(rec['peak_memory_bytes'])}  "
            f"(+{fmt_bytes(rec.get('peak_memory_delta_bytes'))} over the pre-training "
            f"baseline; {rec.get('memory_method')})",
        ),
        ("step time (median)", f"{rec['step_time_s'] * 1e3:.1f} ms over {rec.get('steps')} steps"),
        ("throughput", "n/a" if thr is None else f"{thr:,.1f} {rec.get('throughput_unit')}"),
        ("train wall time", f"{rec.get('train_time_s', 0):.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("=" * 78, file=file)
    for k, v in rows:
        print(f"{k:<{width}} : {v}", file=file)
    print("=" * 78, file=file)
