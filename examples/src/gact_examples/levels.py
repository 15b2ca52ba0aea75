"""How the examples name GACT levels in tables and charts."""

from __future__ import annotations

import gact

__all__ = ["BASELINE", "bits_label", "chart_label", "level_label", "matched_level", "split_level"]

# NOTE [fp32 is level L0]
# Every comparison's fp32 baseline runs at level L0: GACT's hooks are installed and count each
# saved tensor but store it as it is. Saved-activation bytes are thus measured by the same code at
# every level, and tables and charts call L0 "fp32" (level_label) so that one name means one run.
BASELINE = "L0"


# NOTE [Matched levels]
# An adaptive level stores its average bits per element with metadata and masks inside, a
# uniform level its bits with them on top, so L2 stores 6-36% less than L1 on the examples.
# Comparing them at their defaults mixes the benefit of adapting with that of storing more. The
# benchmark's "L2@L1" is L2 given L1's stored bytes as its memory budget (``--memory-budget``,
# the bytes of the same example and seed's L1 run): the two then differ in how the bytes are
# spread only.


def matched_level(adaptive: str, uniform: str) -> str:
    """The name of ``adaptive`` run at ``uniform``'s stored bytes (NOTE [Matched levels]).

    Example:
        >>> matched_level("L2", "L1")
        'L2@L1'
    """
    return f"{adaptive}@{uniform}"


def split_level(level: str) -> tuple[str, str | None]:
    """The GACT level a benchmark level runs, and the level whose bytes it is given (``None``
    for a level run at its defaults).

    Raises:
        KeyError: either part is not a GACT level, or the first is not adaptive.

    Example:
        >>> split_level("L2.2@L1.2"), split_level("L1")
        (('L2.2', 'L1.2'), ('L1', None))
    """
    level_name, sep, uniform = level.partition("@")
    for name in (level_name, uniform) if sep else (level_name,):
        if name not in gact.LEVELS:
            raise KeyError(f"unknown GACT level {name!r}; valid levels: {', '.join(gact.LEVELS)}")
    if sep and not gact.LEVELS[level_name].adaptive:
        raise KeyError(f"{level!r}: only an adaptive level can run at another level's bytes")
    return level_name, uniform or None


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
        level: a key of ``gact.LEVELS``, a matched level (``L2@L1``), or ``"fp32"`` (a run
            without GACT).

    Raises:
        KeyError: ``level`` is not a GACT level; the message lists the valid ones.

    Example:
        >>> [bits_label(lv) for lv in ("L0", "L1", "L2.2", "L2@L1")]
        ['32 bit', '4 bit', 'adaptive, 2 bit avg', 'adaptive, L1 bytes']
    """
    if level in (BASELINE, "fp32"):
        return "32 bit"
    name, uniform = split_level(level)
    if uniform is not None:
        return f"adaptive, {uniform} bytes"
    spec = gact.LEVELS[name]
    text = f"{spec.bits} bit" if spec.bits is not None else f"adaptive, {spec.avg_bits:g} bit avg"
    return text + (" + swap" if spec.swap else "")


def chart_label(level: str) -> str:
    """A chart's x label: the level's name over what it stores, on short lines.

    Example:
        >>> chart_label("L2")
        'L2\\nadaptive,\\n4 bit avg'
    """
    return f"{level_label(level)}\n{bits_label(level)}".replace(", ", ",\n")
