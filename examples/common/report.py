"""Running example scripts in subprocesses, aggregating their JSON records, tables and charts.

Used by ``demo.py`` (one seed, a few levels) and ``bench.py`` (all examples, levels and seeds).
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "gnn": EXAMPLES / "gnn" / "train_gnn.py",
    "vision": EXAMPLES / "vision" / "train_vision.py",
    "text": EXAMPLES / "text" / "train_char_gpt.py",
}
LEVEL_LABEL = {"L0": "fp32"}


def level_label(level: str) -> str:
    return LEVEL_LABEL.get(level, level)


def script_command(script: str, args: Sequence[str]) -> list[str]:
    return [sys.executable, str(SCRIPTS[script]), *args]


def display_command(cmd: Sequence[str], root: Path | None = None) -> str:
    """The command as a user would type it: ``python examples/...`` relative to the repo root."""
    root = root or EXAMPLES.parent
    parts = ["python"]
    for a in cmd[1:]:
        try:
            a = str(Path(a).relative_to(root)) if os.path.isabs(a) else a
        except ValueError:
            pass
        parts.append(a)
    return shlex.join(parts)


def run_json(
    cmd: Sequence[str],
    json_path: Path,
    log_path: Path | None = None,
    timeout: float | None = None,
    env: dict | None = None,
) -> dict[str, Any]:
    """Run ``cmd`` (which writes ``json_path``) and return the record, or an error record."""
    json_path.unlink(missing_ok=True)
    full_env = {**os.environ, **(env or {})}
    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, env=full_env
        )
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"timeout after {timeout}s\n{exc.stdout or ''}{exc.stderr or ''}", -1
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"$ {shlex.join(cmd)}\n{out}" if isinstance(out, str) else str(out))
    if rc == 0 and json_path.exists():
        return json.loads(json_path.read_text())
    tail = "\n".join(str(out).strip().splitlines()[-15:])
    return {"error": f"exit code {rc}", "output_tail": tail}


def mean_std(values: Sequence[float | None]) -> tuple[float, float, int]:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return math.nan, math.nan, 0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0), len(vals)


def fmt_ms(mean: float, std: float, digits: int = 2, scale: float = 1.0, unit: str = "") -> str:
    if math.isnan(mean):
        return "n/a"
    if std == 0:
        return f"{mean * scale:.{digits}f}{unit}"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}{unit}"


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "device": "cpu",
    }
    try:
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    if torch.cuda.is_available():
        info["device"] = f"cuda ({torch.cuda.get_device_name(0)})"
    return info


def bar_chart(
    path: Path,
    title: str,
    panels: list[tuple[str, list[str], list[float], list[float]]],
    figsize=(10, 3.2),
    ncols: int | None = None,
) -> None:
    """A grid of bar panels, each (title, x labels, values, error bars); ``ncols`` per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = ncols or len(panels)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False)
    axes = list(axes.flat)
    for ax in axes[len(panels) :]:
        ax.axis("off")
    colors = ["#7f7f7f", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    for ax, (ylabel, labels, vals, errs) in zip(axes, panels):
        x = range(len(labels))
        ax.bar(x, vals, yerr=errs, color=[colors[i % len(colors)] for i in x], capsize=3)
        ax.set_xticks(list(x), labels, rotation=0, fontsize=8)
        ax.set_title(ylabel, fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
        pairs = [(v, e or 0.0) for v, e in zip(vals, errs) if math.isfinite(v)]
        if pairs and any(k in ylabel.lower() for k in ("acc", "loss")):  # zoom on differences
            lo = min(v - e for v, e in pairs)
            hi = max(v + e for v, e in pairs)
            pad = max(0.02 * abs(hi), 0.25 * (hi - lo))
            ax.set_ylim(lo - pad, hi + pad)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
