"""Running example scripts in subprocesses and aggregating their JSON records.

Used by ``examples/demo.py`` (one seed, a few levels) and ``examples/bench.py`` (every example,
levels and seeds). Each run is its own process so that its peak memory is its own.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "fmt_mean_std",
    "machine_info",
    "mean_std",
    "publish",
    "python_command",
    "run_json",
]


def run_json(
    cmd: Sequence[str],
    json_path: Path,
    log_path: Path | None = None,
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    show_stderr: bool = False,
) -> dict[str, Any]:
    """Run ``cmd``, which writes its record to ``json_path``, and return the record.

    Args:
        cmd: the command (``[sys.executable, script, *options]``).
        json_path: where the command writes its JSON record (removed first).
        log_path: where to write the command line and its output.
        timeout: seconds before the run is killed and reported as failed.
        env: variables added to this process's environment.
        show_stderr: let the run write its stderr (progress bars, warnings, tracebacks) to this
            process's stderr instead of capturing it; the log then holds stdout only.

    Returns:
        The record, or ``{"error": ..., "output_tail": ...}`` when the run failed: a failed run
        is a result to report, not an exception.
    """
    json_path.unlink(missing_ok=True)
    stderr = None if show_stderr else subprocess.STDOUT
    try:
        proc = subprocess.run(
            list(cmd),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
        out, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        out, rc = f"timeout after {timeout}s\n{partial}", -1
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"$ {shlex.join(cmd)}\n{out}")
    if rc == 0 and json_path.exists():
        return json.loads(json_path.read_text())
    tail = "\n".join(out.strip().splitlines()[-15:])
    if show_stderr:
        tail += "\n(its stderr, with any traceback, was printed above)"
    return {"error": f"exit code {rc}", "output_tail": tail}


def publish(
    records: list[dict[str, Any]],
    table: Callable[[list[dict[str, Any]]], str],
    plot: Callable[[list[dict[str, Any]], str], None],
    *,
    json_path: str | None,
    plot_path: str | None,
) -> None:
    """Print a benchmark's ``table`` of ``records``; write them as JSON to ``json_path`` and
    ``plot`` them to ``plot_path``, each when given."""
    print(table(records))
    if json_path:
        Path(json_path).write_text(json.dumps(records, indent=1))
    if plot_path:
        plot(records, plot_path)


def mean_std(values: Sequence[float | None]) -> tuple[float, float, int]:
    """Mean, sample standard deviation and count of the finite values (None and NaN skipped).

    The standard deviation of a single value is 0; of none, NaN.

    Example:
        >>> mean_std([1.0, 3.0, None, float("nan")])
        (2.0, 1.4142135623730951, 2)
    """
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return math.nan, math.nan, 0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0), len(vals)


def fmt_mean_std(mean: float, std: float, digits: int = 2, unit: str = "") -> str:
    """``mean ± std`` (just ``mean`` when ``std`` is 0, ``n/a`` when ``mean`` is NaN).

    Example:
        >>> fmt_mean_std(79.5, 0.707), fmt_mean_std(8.0, 0.0, 1, "×")
        ('79.50 ± 0.71', '8.0×')
    """
    if math.isnan(mean):
        return "n/a"
    if std == 0:
        return f"{mean:.{digits}f}{unit}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}{unit}"


def machine_info() -> dict[str, Any]:
    """CPU model, cores, torch threads and versions, memory, and the device the runs use."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "device": "cpu",
    }
    try:
        mem_kib = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        info["memory_gib"] = round(int(mem_kib) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    if torch.cuda.is_available():
        info["device"] = f"cuda ({torch.cuda.get_device_name(0)})"
    return info


def python_command(script: Path, args: Sequence[str]) -> list[str]:
    """The command that runs ``script`` with this interpreter."""
    return [sys.executable, str(script), *args]
