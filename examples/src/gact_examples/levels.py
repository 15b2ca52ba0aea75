"""How the examples name GACT levels in tables and charts."""

from __future__ import annotations

import gact

__all__ = ["BASELINE", "bits_label", "chart_label", "level_label"]

# NOTE [fp32 is level L0]
# Every comparison's fp32 baseline runs at level L0: GACT's hooks are installed and count each
# saved tensor but store it as it is. Saved-activation bytes are thus measured by the same code at
# every level, and tables and charts call L0 "fp32" (level_label) so that one name means one run.
BASELINE = "L0"


def level_label(level: str) -> str:
    """The name a table shows for ``level``: ``fp32`` for the baseline, else the level itself.

    Args:
        level: a key of ``gact.LEVELS``, or ``"fp32"`` (a run without GACT).

    Example:
        >>> level_label("L0"), level_label("L2")
        ('fp32', 'L2')
    """
    return "fp32" if level == BASELINE else level


def bits_label(level: str) -> str:
    """What a level stores per activation element, in a few words.

    Args:
        level: a key of ``gact.LEVELS``, or ``"fp32"`` (a run without GACT).

    Raises:
        KeyError: ``level`` is not a GACT level; the message lists the valid ones.

    Example:
        >>> [bits_label(lv) for lv in ("L0", "L1", "L2.2")]
        ['32 bit', '4 bit', 'adaptive, 2 bit avg']
    """
    if level in (BASELINE, "fp32"):
        return "32 bit"
    if level not in gact.LEVELS:
        raise KeyError(f"unknown GACT level {level!r}; valid levels: {', '.join(gact.LEVELS)}")
    spec = gact.LEVELS[level]
    text = f"{spec.bits} bit" if spec.bits is not None else f"adaptive, {spec.avg_bits:g} bit avg"
    return text + (" + swap" if spec.swap else "")


def chart_label(level: str) -> str:
    """A chart's x label: the level's name over what it stores, on short lines.

    Example:
        >>> chart_label("L2")
        'L2\\nadaptive,\\n4 bit avg'
    """
    return f"{level_label(level)}\n{bits_label(level)}".replace(", ", ",\n")
