"""The examples benchmark's parts: what runs (:mod:`.specs`), the Markdown tables
(:mod:`.tables`) and the charts (:mod:`.plots`). ``examples/bench.py`` runs it."""

from __future__ import annotations

__all__: list[str] = []
