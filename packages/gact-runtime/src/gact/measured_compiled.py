"""Sensitivities of compiled graphs' saves, measured on an eager run of the step (no probe)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch import nn

from .probes import ProbeSession

if TYPE_CHECKING:
    from .hooks import SaveHooks
    from .measured import SensitivityMeter
    from .plan import BitPlan
    from .scope import ScopeTracker

__all__ = ["Fingerprint", "fingerprint", "match", "measure_eagerly"]

# NOTE [Measured compiled saves]
# The meter (NOTE [Measured sensitivities] in measured.py) reads the eager call that makes a
# save: which layer reads it, and that layer's output gradient in the backward. A compiled
# graph's save has no such call, so its sensitivity came from probes: 2.4 s per adaptation of
# the ResNet-18 layout where eager code measures in 0.13 s (BENCHMARKS.md, "Compiled saves
# measured on an eager run"), so the time budget afforded few adaptations. On a
# measuring step of a compiled model the controller therefore runs the step's closure once more
# with dynamo set aside (``torch.compiler.set_stance("force_eager")``), as a probe that leaves
# no trace (NOTE [Probes leave no trace] in probes.py), with a meter attached: the eager code
# measures its saves as it would in an eager model. A compiled save takes the measurement of
# the eager save that holds the same values. Keys cannot tell (eager keys name module scopes
# and counters, compiled ones graph nodes, and the graphs save other tensors: a convolution's
# output where eager code saves the BatchNorm input it is), so each save leaves a fingerprint
# (its element count, dtype, sum and norm, in float64): compiled key K takes the summed
# measurements of the eager keys whose fingerprints are the same set as K's, within the
# backends' rounding (``RTOL``), if no other compiled key fits them and the eager run measured
# them all. Several eager keys can hold the same values (the last ReLU output and the flattened
# input of the classifier after a 1x1 pooling): the compiled save then serves all their reads,
# and its rounding reaches the gradient through each. A save of values the eager run never
# saves (a graph that recomputes, dropout drawn by inductor's own generator), or one that
# others fit too, stays with the probes. Where the same values are read the same way, eager
# code's measurement is what rounding them adds to the gradient in the compiled backward, which
# computes the same products (measured at the level's width, where an eager model's first
# measurement reads its prior allocation's widths). A mismatch only costs probes: values that
# differ by more than ``RTOL`` (half-precision saves whose fused computation rounds otherwise)
# fit nothing. Dynamo is never entered for the eager run, so nothing recompiles; the run costs
# about an eager step, counted as adaptation time.

#: relative tolerance of a fingerprint's sum (against the norm times the square root of the
#: element count) and norm: eager and compiled code sum in other orders
RTOL = 1e-4


class Fingerprint(NamedTuple):
    """What identifies a saved tensor's values across eager and compiled code."""

    numel: int
    dtype: torch.dtype
    moments: torch.Tensor  # (sum, norm) in float64, on the tensor's device


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """The fingerprint of ``tensor``'s values (not of its shape or layout).

    Example::

        >>> x = torch.randn(4, 8)
        >>> fingerprint(x).numel == fingerprint(x.t()).numel == 32
        True
    """
    data = tensor.detach()
    moments = torch.stack(
        [data.sum(dtype=torch.float64), torch.linalg.vector_norm(data, dtype=torch.float64)]
    )
    return Fingerprint(data.numel(), data.dtype, moments)


def _distinct(prints: list[tuple[int, torch.dtype, float, float]]) -> list[tuple]:
    """``prints`` without repeats (a tensor saved again at its key)."""
    out: list[tuple] = []
    for p in prints:
        if not any(_close(p, q) for q in out):
            out.append(p)
    return out


def _close(a: tuple, b: tuple) -> bool:
    (n, dtype, total, norm), (m, other, total2, norm2) = a, b
    if n != m or dtype != other:
        return False
    scale = max(norm, norm2)
    return abs(norm - norm2) <= RTOL * scale and abs(total - total2) <= RTOL * scale * n**0.5


def _host(prints: dict[str, list[Fingerprint]]) -> dict[str, list[tuple]]:
    """The distinct fingerprints per key, their moments read to the host (one copy per
    device)."""
    by_device: dict[torch.device, list[tuple[str, Fingerprint]]] = {}
    for key, ps in prints.items():
        for p in ps:
            by_device.setdefault(p.moments.device, []).append((key, p))
    out: dict[str, list[tuple]] = {}
    for items in by_device.values():
        moments = torch.stack([p.moments for _, p in items]).cpu().tolist()
        for (key, p), (total, norm) in zip(items, moments):
            out.setdefault(key, []).append((p.numel, p.dtype, total, norm))
    return {k: _distinct(v) for k, v in out.items()}


def match(
    compiled: dict[str, list[Fingerprint]], eager: dict[str, list[Fingerprint]]
) -> dict[str, list[str]]:
    """The eager keys whose saves hold the values of each compiled key's saves, where some do
    and no other compiled key's fit them (NOTE [Measured compiled saves])."""
    ours, theirs = _host(compiled), _host(eager)

    def same(a: list[tuple], b: list[tuple]) -> bool:
        return len(a) == len(b) and all(any(_close(p, q) for q in b) for p in a)

    fits = {k: [e for e, ps in theirs.items() if same(prints, ps)] for k, prints in ours.items()}
    taken: dict[str, int] = {}
    for found in fits.values():
        for e in found:
            taken[e] = taken.get(e, 0) + 1
    return {k: found for k, found in fits.items() if found and all(taken[e] == 1 for e in found)}


def measure_eagerly(
    meter: SensitivityMeter,
    eager: SensitivityMeter,
    closure: Callable[[], Any],
    *,
    model: nn.Module,
    plan: BitPlan,
    hooks: SaveHooks,
    tracker: ScopeTracker,
    run_closure: Callable[[Callable[[], Any]], Any],
    seed: int,
) -> None:
    """Measure the compiled saves ``meter`` saw in the step that ``closure`` ran, on one more
    run of it in eager code with ``eager`` (a fingerprinting meter) attached (NOTE [Measured
    compiled saves]); the time is ``meter``'s."""
    start = time.perf_counter()
    session = ProbeSession(model, plan, hooks, closure, run_closure, [], seed=seed, meter=eager)
    with session, _eager(tracker):
        session.run(np.zeros(0, np.int64), np.zeros(0, np.uint64))
    measured = eager.sensitivities()
    names = match(meter.fingerprints, eager.fingerprints)
    meter.adopt(
        {
            k: sum(measured[e] for e in found)
            for k, found in names.items()
            if set(found) <= measured.keys()
        }
    )
    meter.seconds += time.perf_counter() - start


@contextlib.contextmanager
def _eager(tracker: ScopeTracker) -> Iterator[None]:
    """Run the model's compiled code eagerly, and let GACT's scope treat it as eager code."""
    with torch.compiler.set_stance("force_eager"):
        tracker.forced_eager = True
        try:
            yield
        finally:
            tracker.forced_eager = False
