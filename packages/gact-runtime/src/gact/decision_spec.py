"""What a call's backward does with its saved tensors, as the hooks read it while the call runs:
``DecisionSpec`` (comparisons, widths, groups, what to keep), and the linear uses a sensitivity
meter measures (``LinearUse``, ``BatchNormUse``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["EXACT", "BatchNormUse", "DecisionSpec", "LinearUse", "Rule", "argument"]


@dataclass(frozen=True)
class LinearUse:
    """A call whose backward reads one saved argument only for a parameter's gradient, and
    linearly (NOTE [Measured sensitivities] in measured.py).

    Args:
        numel: elements of that argument; its saves during the call (the argument, a view or
            autocast's copy of it) have as many.
        conv: ``(stride, padding, dilation, groups, kernel)`` of a convolution, per spatial
            dimension; ``None``: the gradient is ``g^T x`` over rows of the last dimension
            (``F.linear``, ``x @ W``, ``addmm``).
        bias: the product adds a trainable bias (``F.linear``'s, ``addmm``'s input), whose
            gradient sums the output gradient's rows (NOTE [Measured pointwise inputs] in
            measured_pointwise.py).
    """

    numel: int
    conv: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, tuple[int, ...]] | None
    bias: bool = False

    def reads(self, tensor: torch.Tensor) -> bool:
        """Whether a save of ``tensor`` made during the call is that argument."""
        if tensor.numel() != self.numel or tensor.dim() == 0:
            return False
        return self.conv is None or tensor.dim() == len(self.conv[4]) + 2


@dataclass(frozen=True)
class BatchNormUse:
    """A BatchNorm on batch statistics, whose input a sensitivity meter measures from the
    call's output gradient when a measured linear layer or convolution produced that input
    (NOTE [Measured BatchNorm inputs] in measured_norms.py).

    Args:
        numel: elements of the input.
        weight: the affine weight ``γ`` (``None``: the call has none).
        eps: the call's ``eps``, added to each channel's variance.
    """

    numel: int
    weight: torch.Tensor | None
    eps: float

    def reads(self, tensor: torch.Tensor) -> bool:
        """Whether a save of ``tensor`` made during the call is the input."""
        return tensor.numel() == self.numel and tensor.dim() >= 2


# NOTE [Specs per call]
# A spec is built by the rule of every call that has one, in every forward (a GELU, a
# BatchNorm, a LayerNorm: one per layer), so it is a plain slotted dataclass: building a frozen
# one costs six times as much (every field set through ``object.__setattr__``). Specs are
# values all the same: nothing assigns to a spec's fields once it is built, and the shared ones
# below (``_EXACT``, ``_RELU``, ...) are returned by many calls.
@dataclass(slots=True)
class DecisionSpec:
    """What the backward of one call decides on its saved tensors.

    Args:
        predicates: ``(strict, t)`` pairs: ``x > t`` if ``strict`` else ``x >= t``.
        exact: keep the call's saved tensors uncompressed instead.
        zero_exact: the call saves only its non-negative output and decides ``y > 0``: quantize
            it with ``zero_exact=True`` and keep no mask for that predicate (NOTE [Exact
            decisions] in decisions.py).
        exact_ids: ``id()`` of the call's arguments to keep uncompressed when saved.
        derivative: the call is a pointwise function whose backward reads its input only
            through the derivative (a key of ``pointwise.DERIVATIVES``): the save of the
            argument whose ``id()`` is ``derivative_id`` may use a derivative table (NOTE
            [Derivative tables] in pointwise.py).
        derivative_id: ``id()`` of that argument.
        min_bits: the smallest width of the saves of the arguments named by ``precise_ids``
            (NOTE [Attention and row normalisations] in decision_rules.py); 0 sets none.
        extra_bits: the saves of ``precise_ids`` prefer this many bits more than the level's
            width (its nominal width at adaptive levels), at most 8, where the level affords
            them (BatchNorm of small maps: NOTE [Small maps] in norm_rules.py); 0 adds none.
        precise_ids: ``id()`` of the call's arguments that take ``min_bits`` and
            ``extra_bits`` when saved.
        exact_numel: saves made during the call with at most this many elements are kept
            uncompressed (per-row statistics: log-sum-exp, mean, reciprocal spread).
        rows_id: ``id()`` of the argument whose save is grouped by rows of ``row_length``
            trailing elements, no group spanning two rows.
        row_length: elements per row of that argument.
        channels_id: ``id()`` of the argument whose save is grouped by channels (dimension 1),
            no group spanning two channels (a BatchNorm's input of rank 2 or 3; saves of rank
            4 or more are grouped so anyway).
        linear: the call reads one saved argument only linearly into a parameter's gradient;
            set only while a sensitivity meter runs (``measuring``).
        batch_norm: the call is a BatchNorm on batch statistics; set only while a sensitivity
            meter runs.
        only_decisions: the backward reads the call's saves only through the outcomes of
            ``predicates`` (or of ``y > 0`` on the zero-exact grid), which stay exact, so their
            rounding never reaches the gradient (NOTE [Measured sensitivities] in measured.py):
            such a save is stored as those outcomes alone (NOTE [Decision-only saves] in
            saved.py).
        shape_ids: ``id()`` of the call's arguments whose saves the backward reads only for
            their shape: stored as the shape alone (NOTE [Shape-only saves] in decision_rules.py).
        recompute: the call runs as ``attention.recomputed``, whose backward recomputes it from
            its rounded saves (NOTE [Attention from its rounded inputs] in attention.py).
        log_softmax: the call computes a ``log_softmax`` (``log_softmax``, ``cross_entropy``)
            whose output its backward reads through ``exp``: the saves made during the call
            that are that output, or views of it (their autograd node, or their base's, is
            ``log_softmax``'s), are stored as probabilities (NOTE [Log-probabilities] in
            decision_rules.py).
        log_probabilities_id: ``id()`` of the one save of the call stored so (a compiled
            graph's, whose tensors have no autograd node).
    """

    predicates: tuple[tuple[bool, float], ...] = ()
    exact: bool = False
    zero_exact: bool = False
    exact_ids: frozenset[int] = frozenset()
    derivative: str | None = None
    derivative_id: int | None = None
    min_bits: int = 0
    extra_bits: int = 0
    precise_ids: frozenset[int] = frozenset()
    exact_numel: int = 0
    rows_id: int | None = None
    row_length: int = 0
    channels_id: int | None = None
    linear: LinearUse | None = None
    batch_norm: BatchNormUse | None = None
    only_decisions: bool = False
    shape_ids: frozenset[int] = frozenset()
    recompute: bool = False
    log_softmax: bool = False
    log_probabilities_id: int | None = None

    @property
    def decides(self) -> bool:
        """Whether the call's backward branches on, or needs exactly or precisely, a saved
        tensor."""
        return bool(
            self.predicates
            or self.exact
            or self.zero_exact
            or self.exact_ids
            or self.min_bits
            or self.extra_bits
        )

    def bits_floor(self, tensor: torch.Tensor) -> int:
        """The smallest width of a save of ``tensor`` made during the call (0: none)."""
        return self.min_bits if id(tensor) in self.precise_ids else 0

    def preferred_bits(self, tensor: torch.Tensor, nominal: int) -> int:
        """The width a save of ``tensor`` made during the call takes at least, where the level
        (whose width is ``nominal``) affords it (0: none; NOTE [Small maps] in
        norm_rules.py)."""
        if not self.extra_bits or id(tensor) not in self.precise_ids:
            return 0
        return min(8, nominal + self.extra_bits)

    def shape_only(self, tensor: torch.Tensor) -> bool:
        """Whether a save of ``tensor`` made during the call is read only for its shape: one
        of ``shape_ids`` or a view of one (NOTE [Shape-only saves] in decision_rules.py)."""
        base = tensor._base
        return id(tensor) in self.shape_ids or (base is not None and id(base) in self.shape_ids)

    def log_probabilities(self, tensor: torch.Tensor) -> bool:
        """Whether a save of ``tensor`` made during the call holds log-probabilities its
        backward reads through ``exp`` (NOTE [Log-probabilities] in decision_rules.py)."""
        if self.log_probabilities_id is not None:
            return id(tensor) == self.log_probabilities_id
        if not self.log_softmax:
            return False
        base = tensor._base
        node = (tensor if base is None else base).grad_fn
        return node is not None and type(node).__name__ == "LogSoftmaxBackward0"

    def keeps(self, tensor: torch.Tensor) -> bool:
        """Whether a save of ``tensor`` made during the call is kept uncompressed."""
        return self.exact or id(tensor) in self.exact_ids or tensor.numel() <= self.exact_numel

    def shapes(self, tensor: torch.Tensor) -> bool:
        """Whether the call asks a save of ``tensor`` for a width (a floor or preferred bits)
        or a group layout (rows, channels) of its own, which another call's save of it may not
        have."""
        ident = id(tensor)
        precise = ident in self.precise_ids and bool(self.min_bits or self.extra_bits)
        return precise or ident == self.rows_id or ident == self.channels_id


EXACT = DecisionSpec(exact=True)  # the spec of a call whose saves are all kept

# A call's rule: its ``DecisionSpec`` from its arguments, ``None`` when its saves need none.
Rule = Callable[[Sequence[Any], dict[str, Any]], "DecisionSpec | None"]


def argument(
    args: Sequence[Any], kwargs: dict[str, Any], position: int, name: str, default: Any
) -> Any:
    """A call's argument at ``position``, or passed as ``name``, or ``default``."""
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)
