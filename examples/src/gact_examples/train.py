"""Training-loop helpers shared by every example script.

The pieces, in the order a script uses them:

* :func:`base_parser` and :func:`check_args` - the common command line (``--data --epochs --seed
  --device --gact --level --get-mem --json ...``);
* :func:`setup` - seeds, device, thread count;
* :class:`Run` - owns the optional GACT :class:`~gact.Controller`, times every step, measures peak
  memory and collects ``controller.stats()``; ``run.step(closure)`` is the one call per iteration;
* :meth:`Run.result` and :func:`finish` - the JSON record and the one-screen summary at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import gact
import numpy as np
import torch
from gact.integrations import DEFAULT_PROBE_SHARE, probe_rows

from .data import default_data_root
from .memory import MemoryMeter, live_tensor_peak, tune_malloc_for_measurement

__all__ = [
    "LEVELS",
    "REQUIRED_KEYS",
    "Run",
    "base_parser",
    "check_args",
    "finish",
    "fmt_bytes",
    "print_summary",
    "progress",
    "selected_epoch",
    "setup",
    "sub_batch_probe",
    "write_json",
]

T = TypeVar("T")
B = TypeVar("B")
LEVELS = tuple(gact.LEVELS)
# Every JSON record carries at least these keys (the benchmark, the demo and the tests rely on
# them; see "The JSON record" in examples/README.md).
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


def base_parser(
    description: str, *, epochs: int, batch_size: int | None = None
) -> argparse.ArgumentParser:
    """The options every example script takes; scripts add their own.

    Args:
        description: the script's one-line description.
        epochs: the script's default ``--epochs``.
        batch_size: the default ``--batch-size``; ``None`` adds no such option (full batch).

    Example:
        >>> args = base_parser("demo", epochs=3).parse_args(["--gact", "--level", "L2.2"])
        >>> args.epochs, args.gact, args.level
        (3, True, 'L2.2')
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--data",
        default=default_data_root(),
        help="the dataset's folder, or the folder holding it (default: $GACT_DATA)",
    )
    p.add_argument("--epochs", type=int, default=epochs)
    if batch_size is not None:
        p.add_argument("--batch-size", type=int, default=batch_size)
        p.add_argument(
            "--probe-batch",
            type=int,
            default=None,
            help="adaptive levels: sensitivity probes run on the first this many rows of the "
            "step's batch (default: a quarter of it; the tensors read linearly need no probe)",
        )
    p.add_argument("--lr", type=float, default=None, help="learning rate (default per model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gact", action="store_true", help="train with GACT (see --level)")
    p.add_argument("--level", default="L2", choices=LEVELS, help="GACT optimization level")
    p.add_argument(
        "--gact-seed",
        type=int,
        default=0,
        help="seed of GACT's stochastic rounding (GactConfig.seed); --seed seeds the model",
    )
    p.add_argument(
        "--no-derivative-tables",
        action="store_true",
        help="quantize GELU/SiLU inputs instead of storing derivative tables",
    )
    p.add_argument(
        "--adapt-interval",
        type=int,
        default=None,
        help="steps between sensitivity probes at adaptive levels (default: the library's)",
    )
    p.add_argument(
        "--memory-budget",
        type=int,
        default=None,
        metavar="BYTES",
        help="adaptive levels: bytes the saved tensors of one step may occupy, metadata "
        "included (GactConfig.memory_budget; default: the level's average bits)",
    )
    p.add_argument(
        "--get-mem",
        action="store_true",
        help="memory run: train --mem-steps steps only, print the memory breakdown, no eval",
    )
    p.add_argument("--mem-steps", type=int, default=5)
    p.add_argument(
        "--tune-malloc",
        action="store_true",
        help="memory run on the CPU: make glibc return freed memory (mmap threshold 128 KiB), "
        "so that the resident peak follows live memory; the default measures the process as "
        "users run it",
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="print the controller's per-tensor report (bits, sensitivity ± SE) at the end",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, needs_data: bool
) -> None:
    """Reject option combinations the parser cannot see, through ``parser.error`` (exit code 2).

    Args:
        parser: the parser that produced ``args``.
        args: the parsed options.
        needs_data: whether this run reads files from ``--data``.
    """
    if needs_data and args.data is None:
        parser.error(
            "no data folder: pass --data DIR (the dataset's folder or the folder holding it) "
            "or set GACT_DATA"
        )
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device {args.device}: torch.cuda.is_available() is False here (CPU build of "
            "torch, or no GPU); use --device cpu"
        )
    if args.memory_budget is not None and not (args.gact and gact.LEVELS[args.level].adaptive):
        adaptive = ", ".join(k for k, v in gact.LEVELS.items() if v.adaptive)
        parser.error(f"--memory-budget needs --gact and an adaptive --level ({adaptive})")
    for name in ("epochs", "mem_steps", "batch_size", "probe_batch", "memory_budget"):
        value = getattr(args, name, None)  # None: the option is absent or left to its default
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


def setup(args: argparse.Namespace) -> torch.device:
    """Seed every RNG, set the thread count, return the device.

    With ``--tune-malloc`` a memory run on the CPU tunes glibc malloc so that the resident size
    follows live memory (:func:`~gact_examples.memory.tune_malloc_for_measurement`); by default
    it measures the process under the malloc users run, and the live-tensor peak beside it.
    """
    args.malloc_tuned = False
    if args.get_mem and args.tune_malloc and torch.device(args.device).type != "cuda":
        args.malloc_tuned = tune_malloc_for_measurement()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    return torch.device(args.device)


def progress(iterable: Iterable[T], args: argparse.Namespace, **kw: Any) -> Iterator[T]:
    """A tqdm bar over ``iterable``, unless ``--no-progress`` or stderr is not a terminal."""
    from tqdm.auto import tqdm

    disable = args.no_progress or not sys.stderr.isatty()
    return tqdm(iterable, disable=disable, dynamic_ncols=True, leave=False, **kw)


def sub_batch_probe(
    args: argparse.Namespace, rows: int, closure: Callable[..., torch.Tensor]
) -> tuple[Callable[[], torch.Tensor], float] | None:
    """``Run.step``'s ``probe``: ``closure(n)`` on the first ``n`` rows of a batch of ``rows``,
    ``n`` being ``--probe-batch`` or by default what GACT's callbacks probe on
    (``gact.integrations.probe_rows``: a quarter, at least 2); ``None`` when that is the whole
    batch."""
    n = probe_rows(rows, args.probe_batch or DEFAULT_PROBE_SHARE)
    if n >= rows:
        return None
    return functools.partial(closure, n), n / rows


def selected_epoch(val_losses: Sequence[float]) -> int:
    """The epoch whose model a run reports: the lowest validation loss, the earliest on ties.

    This is Kipf & Welling's early-stopping criterion, used by the Cora examples. Selecting on
    validation *accuracy* (500 nodes: steps of 0.2 points, many ties) picks another epoch under
    any small perturbation: BENCHMARKS.md ("Model selection on Cora") measures it moving the
    reported test accuracy by up to a point without any compression.

    Raises:
        ValueError: no epochs.

    Example:
        >>> selected_epoch([0.9, 0.7, 0.8, 0.7])
        1
    """
    if not val_losses:
        raise ValueError("no epochs to select from")
    return min(range(len(val_losses)), key=lambda i: (val_losses[i], i))


# --------------------------------------------------------------------------------------------
# the run


class Run:
    """Bookkeeping for one training run: GACT controller, step times, activation stats, memory.

    Used as a context manager around the training loop: entering starts the memory window (and
    the controller's hooks are already installed), leaving stops it and uninstalls the hooks.

    Args:
        args: the parsed options (``--gact``, ``--level``, ``--adapt-interval`` are read).
        model: the model being trained.
        device: where it trains.

    Example:
        >>> from torch import nn
        >>> args = base_parser("x", epochs=1).parse_args(["--gact", "--level", "L1"])
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        >>> x, y = torch.randn(32, 64), torch.randint(0, 2, (32,))
        >>> def closure():
        ...     loss = nn.functional.cross_entropy(model(x), y)
        ...     model.zero_grad()
        ...     loss.backward()
        ...     return loss
        >>> with Run(args, model, torch.device("cpu")) as run:
        ...     loss = run.step(closure)
        >>> run.level, run.stats["stored_bytes"] < run.stats["original_bytes"]
        ('L1', True)
    """

    def __init__(
        self, args: argparse.Namespace, model: torch.nn.Module, device: torch.device
    ) -> None:
        self.args = args
        self.model = model
        self.device = device
        self.controller = self._make_controller(model, args)
        self.memory = MemoryMeter(device)
        self.live_peak: int | None = None  # CPU memory runs: live tensors in one step
        self.step_times: list[float] = []
        self.stats: dict[str, Any] = {}
        # (original, stored) bytes of the step that saved the most, the latest on ties: a
        # partial last batch must not stand for the run's steps
        self.step_bytes: tuple[int, int] | None = None
        self.history: list[dict[str, Any]] = []
        self.n_params = sum(p.numel() for p in model.parameters())
        self.train_time = 0.0
        self._t0 = 0.0

    @staticmethod
    def _make_controller(
        model: torch.nn.Module, args: argparse.Namespace
    ) -> gact.Controller | None:
        if not args.gact:
            return None
        options = {"seed": args.gact_seed, "derivative_tables": not args.no_derivative_tables}
        if args.adapt_interval is not None:
            options["adapt_interval"] = args.adapt_interval
        if args.memory_budget is not None:
            options["memory_budget"] = args.memory_budget
        controller = gact.Controller(model, gact.GactConfig.from_level(args.level, **options))
        controller.install_hook()
        return controller

    @property
    def level(self) -> str:
        """The GACT level, or ``"fp32"`` for a run without ``--gact``."""
        return self.args.level if self.args.gact else "fp32"

    def __enter__(self) -> Run:
        self.memory.start()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.train_time = time.perf_counter() - self._t0
        self.memory.stop()
        if self.controller is not None:
            self.controller.uninstall_hook()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(
        self,
        closure: Callable[[], torch.Tensor],
        probe: tuple[Callable[[], torch.Tensor], float] | None = None,
    ) -> torch.Tensor:
        """One training iteration, timed: ``closure`` runs forward, loss, zero_grad, backward.

        With GACT the closure goes through ``controller.iterate``, which also adapts the bits
        when an adaptive level is due; the caller runs ``optimizer.step()`` afterwards.

        Args:
            closure: the iteration.
            probe: the same closure on a sub-batch for the sensitivity probes, and that
                sub-batch's share of the batch (``iterate``'s ``probe_closure`` and
                ``probe_fraction``); ``None``: probes run ``closure``.

        Returns:
            The loss ``closure`` returned, detached.
        """
        self._sync()
        t = time.perf_counter()

        def iteration() -> torch.Tensor:
            if self.controller is not None:
                probe_closure, fraction = probe or (None, 1.0)
                return self.controller.iterate(
                    closure, probe_closure=probe_closure, probe_fraction=fraction
                )
            return closure()

        cpu_memory_run = self.args.get_mem and self.device.type == "cpu"
        if cpu_memory_run and self.live_peak is None and len(self.step_times) == 1:
            # the second step, after the warm-up: profiled, so not timed
            loss, self.live_peak = live_tensor_peak(iteration)
        else:
            loss = iteration()
            self._sync()
            self.step_times.append(time.perf_counter() - t)
        if self.controller is not None:
            self.stats = dict(self.controller.stats())
            saved = (self.stats["original_bytes"], self.stats["stored_bytes"])
            if self.step_bytes is None or saved[0] >= self.step_bytes[0]:
                self.step_bytes = saved
        return loss.detach()

    def train_steps(
        self,
        next_batch: Callable[[], B],
        loss_of: Callable[[B], torch.Tensor],
        *,
        lr: float,
        total: int,
        steps_per_epoch: int,
        desc: str,
    ) -> None:
        """The loop of the step-based examples (text): AdamW (weight decay 0.01) with a
        one-cycle schedule (10% warm-up) over ``total`` steps, each on a fresh batch from
        ``next_batch()`` with the loss ``loss_of(batch)``; one history entry (the last loss)
        every ``steps_per_epoch`` steps."""
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, lr, total_steps=max(total, 2), pct_start=0.1
        )
        bar = progress(range(total), self.args, desc=desc)
        for step in bar:
            batch = next_batch()

            def closure(rows: int | None = None) -> torch.Tensor:
                self.model.train()
                part = batch if rows is None else tuple(t[:rows] for t in batch)  # noqa: B023
                loss = loss_of(part)  # runs before the next batch is drawn
                optimizer.zero_grad()
                loss.backward()
                return loss

            loss = self.step(closure, sub_batch_probe(self.args, len(batch[0]), closure))
            optimizer.step()
            scheduler.step()
            if (step + 1) % 25 == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}")
            if not self.args.get_mem and (step + 1) % steps_per_epoch == 0:
                self.log_epoch(epoch=(step + 1) // steps_per_epoch, loss=float(loss))

    def log_epoch(self, **values: Any) -> None:
        """Append one entry (epoch, loss, validation metrics, ...) to the record's history."""
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
        """The JSON record of the run: :data:`REQUIRED_KEYS` and more (``extra`` included)."""
        # The first steps include warm-up (allocator, and the first sensitivity probes at
        # adaptive levels); the median over all steps ignores them.
        step_time = statistics.median(self.step_times) if self.step_times else math.nan
        orig, stored = self.step_bytes or (None, None)
        tuned = " + glibc mmap threshold 128 KiB" if getattr(self.args, "malloc_tuned", 0) else ""
        rec: dict[str, Any] = {
            "model": model,
            "dataset": dataset,
            "level": self.level,
            "epochs": self.args.epochs,
            "seed": self.args.seed,
            "gact_seed": self.args.gact_seed if self.args.gact else None,
            "derivative_tables": not self.args.no_derivative_tables if self.args.gact else None,
            "metric": metric,
            "final_metric": final_metric,
            "original_bytes": orig,
            "stored_bytes": stored,
            "compression_ratio": (orig / stored) if orig and stored else None,
            "peak_memory_bytes": self.memory.peak,
            "peak_memory_delta_bytes": self.memory.delta,
            "baseline_memory_bytes": self.memory.baseline,
            "process_peak_memory_bytes": self.memory.process_peak,
            "live_peak_bytes": self.live_peak,
            "cuda_reserved_peak_bytes": self.memory.reserved_peak,
            "memory_method": self.memory.method + tuned,
            "step_time_s": step_time,
            "step_time_mean_s": statistics.fmean(self.step_times) if self.step_times else None,
            "steps": len(self.step_times),
            "throughput": items_per_step / step_time if step_time > 0 else None,
            "throughput_unit": f"{item_unit}/s",
            "train_time_s": self.train_time,
            "compressed_tensors": self.stats.get("compressed_tensors"),
            "skipped_tensors": self.stats.get("skipped_tensors"),
            "adaptations": self.stats.get("adaptations"),
            "adaptation_overhead": self.stats.get("adaptation_overhead"),
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
        """The controller's per-tensor table, or None without GACT."""
        return self.controller.report() if self.controller is not None else None


def write_json(path: str | os.PathLike[str] | None, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` atomically (nothing when ``path`` is None)."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(o: object) -> int | float:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# --------------------------------------------------------------------------------------------
# the ending


def fmt_bytes(n: float | None) -> str:
    """Bytes in B/KiB/MiB/GiB with one decimal; ``n/a`` for None or NaN.

    Example:
        >>> fmt_bytes(512), fmt_bytes(3 * 2**20), fmt_bytes(None)
        ('512 B', '3.0 MiB', 'n/a')
    """
    if n is None or math.isnan(n):
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def finish(args: argparse.Namespace, run: Run, rec: dict[str, Any]) -> dict[str, Any]:
    """The end of every script: the per-tensor report (``--get-mem``, ``--report``), the JSON,
    the summary."""
    report = run.report()
    if (args.get_mem or args.report) and report:
        print(report)
    write_json(args.json, rec)
    print_summary(rec)
    return rec


def print_summary(rec: dict[str, Any], file: IO[str] | None = None) -> None:
    """The one-screen summary every script ends with."""
    fm, ratio, thr = rec.get("final_metric"), rec.get("compression_ratio"), rec.get("throughput")
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
        ("tensors compressed/kept", f"{rec['compressed_tensors']} / {rec['skipped_tensors']}"),
        (
            "peak memory",
            f"{fmt_bytes(rec['peak_memory_bytes'])}  "
            f"(+{fmt_bytes(rec['peak_memory_delta_bytes'])} over the pre-training "
            f"baseline; {rec['memory_method']})",
        ),
        ("step time (median)", f"{rec['step_time_s'] * 1e3:.1f} ms over {rec['steps']} steps"),
        ("throughput", "n/a" if thr is None else f"{thr:,.1f} {rec['throughput_unit']}"),
        ("train wall time", f"{rec['train_time_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    out = file or sys.stdout
    print("=" * 78, file=out)
    for k, v in rows:
        print(f"{k:<{width}} : {v}", file=out)
    print("=" * 78, file=out)
