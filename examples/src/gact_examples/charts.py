"""Bar charts for the demo and the benchmark (matplotlib, written to PNG).

Every axis starts at zero, so bar heights compare honestly; each bar can carry a note (its value,
or a ratio to fp32) so that small differences are read from the numbers, not the bar heights.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Panel", "bar_chart"]

_COLORS = ("#7f7f7f", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


@dataclass(frozen=True)
class Panel:
    """One panel of bars.

    Args:
        title: the panel's title (the quantity and its unit).
        labels: one x label per bar (may hold a line break, e.g. ``"L2\\nadaptive, 4 bit avg"``).
        values: bar heights; NaN draws no bar.
        notes: text above each bar (e.g. ``"98.9%"`` or ``"7.5x less"``); None for none.
        errors: half-lengths of error bars (draw them only for several seeds); None for none.
        limit: the largest meaningful value (100 for an accuracy in %): the axis and its ticks
            end there instead of at the tallest bar.
    """

    title: str
    labels: Sequence[str]
    values: Sequence[float]
    notes: Sequence[str] | None = None
    errors: Sequence[float] | None = None
    limit: float | None = None

    def __post_init__(self) -> None:
        for name in ("values", "notes", "errors"):
            seq = getattr(self, name)
            if seq is not None and len(seq) != len(self.labels):
                raise ValueError(
                    f"Panel {self.title!r}: {len(seq)} {name} for {len(self.labels)} labels; "
                    "give one per bar"
                )


def _draw(ax: Axes, panel: Panel) -> None:
    x = list(range(len(panel.labels)))
    vals = [v if math.isfinite(v) else 0.0 for v in panel.values]
    ax.bar(
        x,
        vals,
        yerr=panel.errors,
        color=[_COLORS[i % len(_COLORS)] for i in x],
        capsize=4 if panel.errors is not None else 0,
    )
    ax.set_xticks(x, list(panel.labels))
    ax.set_title(panel.title)
    top = panel.limit or max([*vals, 0.0]) or 1.0
    ax.set_ylim(0, top * 1.15)  # headroom for the notes
    if panel.limit is not None:  # the axis ends at the limit; the headroom carries no ticks
        ax.set_yticks([t for t in ax.get_yticks() if 0 <= t <= panel.limit])
        ax.spines["left"].set_bounds(0, panel.limit)
    ax.spines[["top", "right"]].set_visible(False)
    errors = panel.errors or [0.0] * len(x)
    for xi, v, err, note in zip(x, vals, errors, panel.notes or ()):
        ax.annotate(
            note,
            (xi, v + (err if math.isfinite(err) else 0.0)),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize="small",
        )


def bar_chart(
    path: Path,
    title: str,
    panels: Sequence[Panel],
    *,
    ncols: int | None = None,
    footnote: str | None = None,
) -> None:
    """Draw ``panels`` side by side (``ncols`` per row) and save a PNG to ``path``.

    Args:
        path: the PNG to write (parent folders are created).
        title: the figure's title.
        panels: the panels, in reading order.
        ncols: panels per row (default: all in one row).
        footnote: text under the panels (wrapped), e.g. what was measured and how.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp()) / "chart.png"
        >>> bar_chart(out, "t", [Panel("acc (%)", ["fp32", "L2"], [98.9, 99.2], limit=100)])
        >>> out.stat().st_size > 0
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("bar_chart needs at least one panel")
    ncols = ncols or len(panels)
    nrows = math.ceil(len(panels) / ncols)
    # about an inch per bar, so that two-line labels of seven bars do not run together
    panel_width = max(4.6, 1.0 * max(len(p.labels) for p in panels))
    width = panel_width * min(ncols, len(panels))
    notes_height = 0.9 if footnote else 0.0
    with plt.rc_context({"font.size": 12, "axes.titlesize": 12, "xtick.labelsize": 11}):
        fig, axes = plt.subplots(
            nrows, ncols, figsize=(width, 4.3 * nrows + notes_height), squeeze=False
        )
        flat = list(axes.flat)
        for ax in flat[len(panels) :]:
            ax.axis("off")
        for ax, panel in zip(flat, panels):
            _draw(ax, panel)
        fig.suptitle(title, fontsize=14)
        bottom = 0.0
        if footnote:
            wrapped = textwrap.fill(footnote, width=int(width * 13))
            fig.text(0.01, 0.01, wrapped, fontsize=10, va="bottom", ha="left")
            bottom = (wrapped.count("\n") + 1) * 0.17 / (4.3 * nrows + notes_height)
        fig.tight_layout(rect=(0, bottom, 1, 1))
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
