"""Exact decisions for backward functions that branch on a saved tensor.

The backward of ReLU keeps the gradient where its saved output is ``> 0``; LeakyReLU, ELU, PReLU,
Hardtanh/ReLU6, Hardsigmoid, Hardswish, threshold, clamp, abs and the shrink functions branch the
same way on a saved tensor. Stochastic rounding moves values across such a threshold (a positive
ReLU output below one quantization step rounds to 0 with probability ``1 - y/step``), which makes
the gradient systematically wrong, not just noisy. This module keeps those decisions exact: it
publishes each such call's ``DecisionSpec`` (decision_spec.py), built by the function's rule
(decision_rules.py), while the call runs, and holds the outcomes of its comparisons. The specs
also tell the hooks which save is the input of a GELU or SiLU call, which may be stored as a
derivative table (NOTE [Derivative tables] in pointwise.py).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gact_kernels
import torch
from torch.overrides import TorchFunctionMode

from . import attention
from .decision_rules import find_rule
from .decision_spec import DecisionSpec
from .linear_rules import PRODUCTS, measuring

__all__ = [
    "DECISION_NODES",
    "Decision",
    "DecisionMode",
    "await_output",
    "current_spec",
    "node_family",
    "product_factors",
    "representable",
    "representatives",
]

# NOTE [Exact decisions]
# While a controlled model's forward runs, ``DecisionMode`` (a TorchFunctionMode) sees every call
# of a function whose backward branches on a saved tensor, before autograd saves that tensor. It
# publishes the call's ``DecisionSpec`` in a thread-local, where ``SaveHooks.pack`` reads it:
# - ``predicates``: the comparisons the backward makes, normalised to ``x > t`` (strict) or
#   ``x >= t``. A compressed save made during the call gets, per predicate, the exact outcome as a
#   1-bit ``PackedMask`` (its bytes are counted in ``stats()`` and in the adaptive budget).
# - ``exact``: the backward compares the saved tensor with another tensor (``maximum``, ``amax``,
#   ``max()``, inf-norms, the margin and L1-type losses, the maximum and minimum reductions of
#   ``scatter_reduce``, ``index_reduce`` and ``segment_reduce``, whose ties share the gradient),
#   or divides by a saved tensor or its logarithm in a way that is unbounded near 0 (``log``,
#   ``sqrt``, ``rsqrt``, powers below 1, ``prod`` and product reductions, ``atan2``, ``xlogy``,
#   distances, ``lgamma``, ``asin``), or solves with it or divides by its eigenvalue gaps (the
#   inverses, factorisations and spectra of ``torch.linalg``), or a threshold is not
#   representable in the tensor's dtype; saves made during the call are kept uncompressed.
#   Rounded, a maximum's ties came out empty (PyG's max aggregation: NaN gradients, 0 / 0) and
#   ``log`` of a rounded input near 0 put gradients off by 100%.
# - ``exact_ids``: the ids of the call's arguments that are kept uncompressed when saved, the
#   others being compressed as usual: the divisor of ``a / b``, whose backward (``g / b`` and
#   ``-g a / b**2``) is nonlinear in it and unbounded as it nears 0, while per-group rounding
#   gives a small divisor among large ones a relative error of up to a whole step (the GAT
#   example's attention normaliser measured a sensitivity 100-1000x any other tensor's), and
#   the grid of ``grid_sample``, whose coordinates the backward floors to pick cells.
# After the call, the class name of the output's ``grad_fn`` (e.g. ``LeakyReluBackward0``) is
# recorded as a *consumer* of those decisions. At unpack, ``torch._C._current_autograd_node()``
# names the node that is unpacking: a consumer gets the dequantized values clamped into the exact
# region given by the masks (``Decision.project``), so every comparison it makes comes out as on
# the original tensor; every other node gets the unbiased dequantized values untouched. A value
# only moves when rounding crossed a threshold, and only for the deciding node.
# ReLU saves only its output ``y >= 0`` and decides ``y > 0``: its spec has ``zero_exact``, and
# its save is quantized on gact-kernels' zero-exact grid (zeros stay exactly 0, positives stay
# positive), which makes that decision exact with no mask at all. The grid needs 2 bits; a ReLU
# output due for 1 bit takes 2 zero-exact bits instead, which cost what 1 bit plus a 1-bit mask
# would, with a quarter of the variance (the allocator's lower width for it is 2).
# Known limit: decisions made inside C++ composite operators that no Python entry point exposes
# are caught at unpack (``DECISION_NODES``): the save site is then kept exact from the next
# forward on and a warning says so once.


# Autograd nodes whose backward branches on a saved tensor (class names without the trailing
# version digit). Used at unpack to find compressed tensors that reached such a node without
# masks, which only happens for decisions this module did not see coming.
DECISION_NODES = frozenset(
    {
        "ReluBackward",
        "ThresholdBackward",
        "LeakyReluBackward",
        "HardtanhBackward",
        "EluBackward",
        "CeluBackward",
        "PreluKernelBackward",
        "RreluWithNoiseBackward",
        "HardsigmoidBackward",
        "HardswishBackward",
        "ClampBackward",
        "ClampMinBackward",
        "ClampMaxBackward",
        "AbsBackward",
        "HardshrinkBackward",
        "SoftshrinkBackward",
        "MaximumBackward",
        "MinimumBackward",
        "FmaxBackward",
        "FminBackward",
        "AmaxBackward",
        "AminBackward",
        "MaxBackward",
        "MinBackward",
        "MedianBackward",
        "NanmedianBackward",
        "SmoothL1LossBackward",
        "HuberLossBackward",
        "L1LossBackward",
        "ProdBackward",
        "CumprodBackward",
        "LogBackward",
        "Log2Backward",
        "Log10Backward",
        "Log1PBackward",
        "SqrtBackward",
        "RsqrtBackward",
        "Atan2Backward",
        "XlogyBackward",
        "CdistBackward",
        "PdistBackward",
        "DistBackward",
        "LinalgInvExBackward",
        "LinalgSolveExBackward",
        "LinalgDetBackward",
        "LinalgSlogdetBackward",
        "LinalgCholeskyExBackward",
        "LinalgEighBackward",
        "LinalgEigBackward",
        "LinalgQrBackward",
        "LinalgSvdBackward",
        "LinalgPinvBackward",
        "LinalgLstsqBackward",
        "HypotBackward",
        "LgammaBackward",
        "DigammaBackward",
        "PolygammaBackward",
        "ErfinvBackward",
        "AsinBackward",
        "AcosBackward",
        "AtanhBackward",
        "AcoshBackward",
    }
)


def node_family(node: object) -> str:
    """``'LeakyReluBackward0'`` -> ``'LeakyReluBackward'``."""
    return type(node).__name__.rstrip("0123456789")


_local = threading.local()


def current_spec() -> DecisionSpec | None:
    """The spec of the decision call running on this thread, if any."""
    return getattr(_local, "spec", None)


def product_factors() -> list[torch.Tensor]:
    """The tensor arguments of the product (``linear_rules.PRODUCTS``) running on this thread
    under ``DecisionMode``, if one runs (NOTE [Products of a shared save] in live.py)."""
    call = getattr(_local, "factors", None)
    if call is None:
        return []
    args, kwargs = call
    found = []
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):  # einsum's operands may come as one list
            found.extend(t for t in arg if isinstance(t, torch.Tensor))
    return found


def await_output(waiter: Any) -> None:
    """Call ``waiter.called(out)`` with the output of the ``DecisionMode`` call running on this
    thread, once it returns (nothing if none runs)."""
    waiting = getattr(_local, "waiting", None)
    if waiting is not None:
        waiting.append(waiter)


class Decision:
    """Exact outcomes of a backward's comparisons on one compressed saved tensor.

    Args:
        tensor: the exact tensor being saved.
        spec: the comparisons (see ``DecisionSpec``).
        skip: a predicate that needs no mask (see ``extend``).
    """

    __slots__ = ("consumers", "masks", "predicates")

    def __init__(
        self, tensor: torch.Tensor, spec: DecisionSpec, *, skip: tuple[bool, float] | None = None
    ) -> None:
        self.predicates: list[tuple[bool, float]] = []
        self.masks: list[gact_kernels.PackedMask] = []
        self.consumers: set[str] = set()
        self.extend(tensor, spec, skip=skip)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.masks)

    def extend(
        self, tensor: torch.Tensor, spec: DecisionSpec, *, skip: tuple[bool, float] | None = None
    ) -> int:
        """Add the masks of ``spec``'s new predicates, but none for ``skip`` (a predicate the
        stored values decide exactly, see NOTE above); returns the bytes added."""
        added = 0
        with torch.no_grad():
            for strict, t in spec.predicates:
                if (strict, t) in self.predicates or (strict, t) == skip:
                    continue
                outcome = tensor > t if strict else tensor >= t
                mask = gact_kernels.pack_mask(outcome)
                self.predicates.append((strict, t))
                self.masks.append(mask)
                added += mask.nbytes
        await_output(self)  # the running call's output names the consumers
        return added

    def called(self, out: Any) -> None:
        """The deciding call returned ``out``: its backward node is a consumer (NOTE above)."""
        node = out.grad_fn if isinstance(out, torch.Tensor) else None
        if node is not None:
            self.consumers.add(type(node).__name__)

    def drop(self, predicate: tuple[bool, float]) -> None:
        """Forget the mask of ``predicate`` (stored values decide it exactly), if any."""
        if predicate in self.predicates:
            i = self.predicates.index(predicate)
            del self.predicates[i], self.masks[i]

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``dtype`` (and the masks' shape and device) whose every comparison has
        the exact outcome: the representative of each element's region (NOTE [Decision-only
        saves] in saved.py)."""
        found = representatives(tuple(self.predicates), dtype)
        assert found is not None, "stored as decisions only where representatives exist"
        order, base, steps = found
        ones = [gact_kernels.unpack_mask(self.masks[i]).to(dtype) for i in order]
        return _assemble(ones, base, steps)  # one or two passes (masked_fill_: 6x slower)

    def project(self, values: torch.Tensor) -> torch.Tensor:
        """Move, in place, the values whose comparisons differ from the exact outcomes to the
        nearest value with the right outcome (see NOTE above). Temporaries are bool tensors."""
        for (strict, t), packed in zip(self.predicates, self.masks):
            outcome = gact_kernels.unpack_mask(packed)
            bound = torch.tensor(t, dtype=values.dtype, device=values.device)
            if strict:  # x > t: true -> the next value above t; false -> t
                inward = (bound, torch.nextafter(bound, bound.new_tensor(math.inf)))
                wrong = values.gt(t)
            else:  # x >= t: true -> t; false -> the value below t
                inward = (torch.nextafter(bound, bound.new_tensor(-math.inf)), bound)
                wrong = values.ge(t)
            wrong.ne_(outcome)
            values.masked_fill_(wrong & outcome, inward[1])
            values.masked_fill_(wrong.logical_and_(outcome.logical_not_()), inward[0])
        return values


def _assemble(ones: list[torch.Tensor], base: float, steps: tuple[float, ...]) -> torch.Tensor:
    """``base + sum(steps[j] * ones[j])`` in the dtype of ``ones`` (tensors of 0 and 1, used up),
    computed as ``Decision.values`` computes it and ``representatives`` checks it."""
    out = ones[0]
    if (base, steps[0]) != (0.0, 1.0):  # a ReLU's 0 and 1 need no arithmetic
        out.mul_(steps[0]).add_(base)
    for one, step in zip(ones[1:], steps[1:]):
        out.add_(one.mul_(step))
    return out


@functools.cache
def representatives(
    predicates: tuple[tuple[bool, float], ...], dtype: torch.dtype
) -> tuple[tuple[int, ...], float, tuple[float, ...]] | None:
    """For comparisons ``x > t`` / ``x >= t``: their order by threshold (``x >= t`` before
    ``x > t``), and a value per region between them, from below every threshold to above all,
    as a base and the steps between consecutive regions: element ``x`` lies in region ``r``
    when exactly the first ``r`` comparisons in that order are true, and its value is ``base``
    plus the first ``r`` steps (``_assemble`` in ``dtype``); ``None`` if some region's value so
    computed does not give that region's outcomes (thresholds closer than ``dtype`` resolves)."""
    order = tuple(
        sorted(range(len(predicates)), key=lambda i: (predicates[i][1], predicates[i][0]))
    )
    bounds = [predicates[i] for i in order]
    levels = []
    for r in range(len(bounds) + 1):
        below = bounds[r - 1] if r else None  # true
        above = bounds[r] if r < len(bounds) else None  # false
        if below is None:
            assert above is not None
            t = above[1]
            level = t if above[0] else t - max(1.0, abs(t))  # x <= t, or x < t
        elif above is None:
            t = below[1]
            level = t + max(1.0, abs(t)) if below[0] else t  # x > t, or x >= t
        elif not below[0]:
            level = below[1]  # x >= t holds at t, and x > t' or x >= t' fails there if t <= t'
        else:
            level = (below[1] + above[1]) / 2
        levels.append(torch.tensor(level, dtype=dtype).item())  # as dtype holds it
    base = levels[0]
    steps = tuple(b - a for a, b in zip(levels, levels[1:]))
    n = len(bounds)
    ones = [torch.tensor([float(j < r) for r in range(n + 1)], dtype=dtype) for j in range(n)]
    values = _assemble(ones, base, steps).tolist()  # every region's value, as unpacked
    for r, value in enumerate(values):  # check every outcome in dtype's arithmetic
        for j, (strict, t) in enumerate(bounds):
            if (value > t if strict else value >= t) != (j < r):
                return None
    return order, base, steps


def representable(spec: DecisionSpec, dtype: torch.dtype) -> bool:
    """Whether every threshold of ``spec`` is exactly a value of ``dtype`` (else keep exact)."""
    return all(_representable(t, dtype) for _, t in spec.predicates)


@functools.cache
def _representable(threshold: float, dtype: torch.dtype) -> bool:
    return torch.tensor(threshold, dtype=dtype).item() == threshold  # once per (t, dtype)


class DecisionMode(TorchFunctionMode):
    """Publishes the ``DecisionSpec`` of decision functions while they run (NOTE above)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # A compiled region inside an eager forward (a block compiled alone) takes its saves'
        # decisions from its compiled backward (NOTE [Compiled saves] in compiled.py): dynamo,
        # tracing this mode there, must not trace the rules (graph breaks) nor their cache
        # (guards that fail as it fills: recompiles).
        if torch.compiler.is_compiling():
            return func(*args, **kwargs) if kwargs else func(*args)
        # a product publishes its arguments, for the hooks (NOTE [Products of a shared save])
        products = func in PRODUCTS
        if products:
            outer_factors = getattr(_local, "factors", None)
            _local.factors = (args, kwargs)
        try:
            rule = find_rule(func, measuring())
            if rule is None:
                return func(*args, **kwargs) if kwargs else func(*args)
            kwargs = kwargs or {}
            spec = rule(args, kwargs)
            if spec is None:
                return func(*args, **kwargs)
            outer, outer_waiting = current_spec(), getattr(_local, "waiting", None)
            _local.spec, _local.waiting = spec, []
            try:
                out = (attention.recomputed if spec.recompute else func)(*args, **kwargs)
                for waiter in _local.waiting:
                    waiter.called(out)
                return out
            finally:
                _local.spec, _local.waiting = outer, outer_waiting
        finally:
            if products:
                _local.factors = outer_factors
