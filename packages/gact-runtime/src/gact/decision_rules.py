"""The rule of each function whose backward branches on a saved tensor, or reads it through more
than a linear formula: the ``DecisionSpec`` of a call from its arguments (NOTE [Exact
decisions] in decisions.py)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import attention
from .decision_spec import BatchNormUse, DecisionSpec, LinearUse

__all__ = [
    "ATTENTION_BITS", "ATTENTION_EXTRA_BITS", "BATCH_NORM_EXTRA_BITS", "PRODUCTS", "SMALL_MAP",
    "SMALL_MAP_EXTRA_BITS", "find_rule", "measuring", "set_measuring", "small_channels",
    "small_map_bits",
]  # fmt: skip

# NOTE [Attention and row normalisations]
# Two more kinds of call read their saves through more than a linear formula:
# - Fused attention (``F.scaled_dot_product_attention`` on its flash, memory-efficient and cuDNN
#   kernels) saves ``q``, ``k``, ``v``, its output and the log-sum-exp of each query row, and its
#   backward recomputes the attention weights as ``exp(q k^T * scale - logsumexp)``: a rounding
#   error in ``q``, ``k`` or the log-sum-exp multiplies weights by ``exp(error)``, whose mean is
#   not 1, so the gradient is biased, not just noisy. On sharp attention at 2 bits the
#   query/key gradients came out 1e10 times too large. Where GACT compresses the call's saves it
#   therefore runs the call as ``attention.recomputed`` (NOTE [Attention from its rounded inputs]
#   in attention.py), which saves ``q``, ``k`` and ``v`` alone and differentiates the call again
#   at their rounded values; ``q`` and ``k`` prefer ``ATTENTION_EXTRA_BITS`` more bits than the
#   level's (their error moves every score of a row; on the LLaMA-style decoder of BENCHMARKS.md,
#   "Stability", the query and key projections' rounding variance at L1 after 300 steps was 9%
#   of the minibatch variance with 6 bits, 22% with 4). Where the fused backward still reads
#   rounded saves (NOTE [Attention from its rounded inputs] lists when), the call's spec gives
#   ``q`` and ``k`` at least ``min_bits`` (6: a score's error a fifth of its error at 4 bits, its
#   variance, and exp's bias with it, 1/18) and keeps the saves of one value per query row (the
#   log-sum-exp, ``exact_numel``) as they are. The math fallback, which saves scaled copies and
#   the attention weights (read linearly or through softmax), gets neither.
# - LayerNorm and RMSNorm divide each row by its own spread, as BatchNorm does each channel
#   (NOTE [channel groups] in gact_kernels/_layout.py): a group spanning rows of different scale
#   (ViT's class token beside its patches) gives the small row an error of many of its own
#   standard deviations. The input is then quantized in groups that never span two rows
#   (``rows_id``/``row_length``, when rows have at least a quarter of a group, so metadata stays
#   at most 1 bit per element), and the per-row mean and reciprocal spread are kept. On the
#   model matrix's ViT, 95% of the class token's rounding variance after 300 steps (5.4x its
#   minibatch variance) came from the first LayerNorm's input; with row groups no layer's
#   rounding variance exceeds 9.3% of its minibatch variance (BENCHMARKS.md, "Stability").
# - BatchNorm normalising by the batch's statistics reads its input through each channel's
#   spread; on small maps its input takes 4 more bits (NOTE [Small maps]).


_EXACT = DecisionSpec(exact=True)
_POSITIVE = DecisionSpec(((True, 0.0),))  # ELU and the like also read the value below 0
_LEAKY = DecisionSpec(_POSITIVE.predicates, only_decisions=True)  # reads only the sign
_RELU = DecisionSpec(_POSITIVE.predicates, zero_exact=True, only_decisions=True)


def _arg(args: Sequence[Any], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _scalar(value: Any) -> float | None:
    """A Python number as float; ``None`` for tensors and other objects."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _between(low: Any, high: Any, *, low_strict: bool, high_strict: bool) -> DecisionSpec:
    """Spec of a backward that passes the gradient where ``low <(=) x <(=) high``.

    ``None`` bounds are absent; a bound that is a tensor makes the decision exact instead.
    """
    preds = []
    for value, strict in ((low, low_strict), (high, not high_strict)):
        if value is None:
            continue
        t = _scalar(value)
        if t is None:
            return _EXACT
        preds.append((strict, t))
    return DecisionSpec(tuple(preds), only_decisions=True)


def _hardtanh(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    low = _arg(args, kwargs, 1, "min_val", -1.0)
    high = _arg(args, kwargs, 2, "max_val", 1.0)
    return _between(low, high, low_strict=True, high_strict=True)


def _clamp(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    low = _arg(args, kwargs, 1, "min", None)
    high = _arg(args, kwargs, 2, "max", None)
    return _between(low, high, low_strict=False, high_strict=False)


def _clamp_min(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    return _between(_arg(args, kwargs, 1, "min", None), None, low_strict=False, high_strict=False)


def _clamp_max(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    return _between(None, _arg(args, kwargs, 1, "max", None), low_strict=False, high_strict=False)


def _threshold(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    low = _arg(args, kwargs, 1, "threshold", None)
    return _between(low, None, low_strict=True, high_strict=False)


def _shrink(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    lambd = _scalar(_arg(args, kwargs, 1, "lambd", 0.5))
    if lambd is None:
        return _EXACT
    # the gradient is zero where -lambd <= x <= lambd
    return DecisionSpec(((False, -lambd), (True, lambd)), only_decisions=True)


def _divisor(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    other = _arg(args, kwargs, 1, "other", None)
    return (
        DecisionSpec(exact_ids=frozenset({id(other)})) if isinstance(other, torch.Tensor) else None
    )


_EXACT_REDUCE = frozenset({"amax", "amin", "max", "min", "prod"})


def _reduction(position: int) -> _Rule:
    """Rule of a scatter, index or segment reduction whose ``reduce`` argument is at
    ``position``: a maximum or minimum shares the gradient among the values equal to the
    result, a product divides by them (NOTE [Exact decisions]); a sum or mean reads nothing."""

    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        return _EXACT if _arg(args, kwargs, position, "reduce", None) in _EXACT_REDUCE else None

    return rule


_LINALG = (
    "inv", "inv_ex", "solve", "solve_ex", "solve_triangular", "det", "slogdet", "cholesky",
    "cholesky_ex", "eigh", "eigvalsh", "eig", "eigvals", "qr", "svd", "svdvals", "pinv",
    "lstsq", "lu", "lu_factor", "lu_factor_ex", "lu_solve", "ldl_factor", "tensorinv",
    "tensorsolve", "cond", "matrix_rank",
)  # fmt: skip
# functions (and Tensor methods) with those backwards, and elementwise ones whose derivative is
# unbounded inside their domain (lgamma's digamma near 0, asin's 1 / sqrt(1 - x**2) near 1)
_INVERSES = (
    "inverse", "det", "logdet", "slogdet", "cholesky", "cholesky_solve", "cholesky_inverse",
    "triangular_solve", "svd", "qr", "pinverse", "lu_solve", "hypot", "lgamma", "digamma",
    "polygamma", "mvlgamma", "erfinv", "asin", "arcsin", "acos", "arccos", "atanh", "arctanh",
    "acosh", "arccosh",
)  # fmt: skip


def _grid(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    """``grid_sample``: its backward floors the grid's coordinates to pick each sample's cell
    (a decision per coordinate) and weighs by their fractions; the input is read linearly."""
    grid = _arg(args, kwargs, 1, "grid", None)
    return DecisionSpec(exact_ids=frozenset({id(grid)})) if isinstance(grid, torch.Tensor) else None


def _rows(x: Any, dim: Any, *, grouped: bool) -> DecisionSpec:
    """Spec of a call dividing the rows of ``x`` along ``dim`` by their norms: its saves of one
    value per row (the norms, a clamp's decision, the divisor) are kept; ``grouped``: ``x``'s
    save is grouped by rows where they are contiguous, as LayerNorm's (NOTE [Attention and row
    normalisations])."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not isinstance(dim, int):
        return _EXACT
    length = x.shape[dim]
    rows = x.numel() // max(length, 1)
    if not grouped or dim % x.dim() != x.dim() - 1:
        return DecisionSpec(exact_numel=rows)
    return DecisionSpec(exact_numel=rows, rows_id=id(x), row_length=length)


def _normalize(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    """``F.normalize``, a Python composite ``DecisionMode`` sees as one call."""
    x, dim = _arg(args, kwargs, 0, "input", None), _arg(args, kwargs, 2, "dim", 1)
    return _rows(x, dim, grouped=True)


def _cosine_similarity(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    """``F.cosine_similarity``, a C++ composite: only its rows' norms are read nonlinearly."""
    x, dim = _arg(args, kwargs, 0, "x1", None), _arg(args, kwargs, 2, "dim", 1)
    return _rows(x, dim, grouped=False)


# NOTE [Log-probabilities]
# ``log_softmax`` saves its output ``l`` and its backward reads it through ``exp``: ``g - exp(l) *
# sum(g)``. Rounded in the log domain, a step of a few nats (a row of a trained language model's
# log-probabilities spans tens) makes ``exp`` of the rounded value biased (convex: the mean of
# ``exp`` over the two neighbouring levels exceeds ``exp`` of the mean): with confident predictions
# an output layer's gradient came out 12-20% off (relative norm), however many seeds were averaged.
# So the save is stored as the probabilities ``p = exp(l)``, rounded unbiasedly, and unpacks to
# ``log(p)``: the backward's ``exp(log(p))`` is ``p`` (a ``p`` rounded to 0 unpacks to ``-inf``, and
# ``exp(-inf) = 0``), linear in the stored values, so the gradient is unbiased. ``nll_loss`` (inside
# ``cross_entropy`` too) saves the same tensor and reads only its shape, so it shares the save; a
# save made by any other call never shares it (its values are not the tensor's). ``F.cross_entropy``
# is where language models' losses compute it, inside the model when ``labels=`` is passed to a
# transformers model. ``logsumexp`` reads ``exp(x - r)`` from two saves, its input and its result,
# which no single stored tensor gives: both are kept (on rows of 1,000 logits spanning tens of nats
# its gradient was 1.6 off, relative norm).
def _log_probabilities(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return DecisionSpec(arguments=frozenset(map(id, tensors)))


def _kept_input(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    """A composite whose inner call decides on its input: the input is kept (exact masks are
    read by the output's backward node only, NOTE [Exact decisions])."""
    x = _arg(args, kwargs, 0, "input", None)
    return DecisionSpec(exact_ids=frozenset({id(x)})) if isinstance(x, torch.Tensor) else None


def _power(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    """``x ** p``: its backward's ``x ** (p - 1)`` is unbounded near 0 for ``p < 1`` (and a
    tensor exponent's reads ``log x``); a number raised to a tensor reads only the output."""
    if not isinstance(_arg(args, kwargs, 0, "input", None), torch.Tensor):
        return None
    p = _scalar(_arg(args, kwargs, 1, "exponent", None))
    return None if p is not None and (p >= 1 or p == 0) else _EXACT


def _gelu(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    approximate = _arg(args, kwargs, 1, "approximate", "none")
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    x = _arg(args, kwargs, 0, "input", None)
    if name is None or not isinstance(x, torch.Tensor):
        return None
    return DecisionSpec(derivative=name, derivative_id=id(x))


def _silu(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    x = _arg(args, kwargs, 0, "input", None)
    if _arg(args, kwargs, 1, "inplace", False) or not isinstance(x, torch.Tensor):
        return None  # in place, the saved tensor is the output's storage
    return DecisionSpec(derivative="silu", derivative_id=id(x))


ATTENTION_BITS = 6  # the smallest width of a fused attention's q and k (NOTE above)
ATTENTION_EXTRA_BITS = 2  # bits above the level's that a recomputed attention's q and k prefer


def _attention(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    q, k = _arg(args, kwargs, 0, "query", None), _arg(args, kwargs, 1, "key", None)
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k)) or not q.numel():
        return None
    if attention.recomputes(args, kwargs):  # NOTE [Attention from its rounded inputs]
        return DecisionSpec(
            extra_bits=ATTENTION_EXTRA_BITS, precise_ids=frozenset({id(q), id(k)}), recompute=True
        )
    rows = q.numel() // q.shape[-1]
    # the memory-efficient kernel pads each head's log-sum-exp to a multiple of 32 rows
    padded = rows // q.shape[-2] * (-(-q.shape[-2] // 32) * 32)
    return DecisionSpec(
        min_bits=ATTENTION_BITS, precise_ids=frozenset({id(q), id(k)}), exact_numel=padded
    )


# NOTE [Small maps]
# A channel with few elements per step (a CIFAR ResNet's 4x4, 2x2 and 1x1 maps at batch 64:
# 1024, 256 and 64) is one group spanning the whole batch (NOTE [channel groups] in
# gact_kernels/_layout.py), so its range is set by its most active sample; after some training
# those channels are sparse (a median kurtosis of 13.6 over layer4's 1x1 channels of the
# ResNet-18 layout at step 150, where a normal distribution has 3), and the other samples keep
# few levels. Their rounding then dominates two kinds of gradient:
# - BatchNorm on batch statistics reads its input through each channel's spread, and its
#   backward carries that input's rounding into every earlier layer's gradient. On the ResNet-18
#   layout after 150 steps at L1, rounding added up to 62% of the minibatch variance to a
#   BatchNorm weight's gradient and 45% to a convolution's; with the BatchNorm inputs of maps of
#   at most ``SMALL_MAP`` elements per channel at 6 bits, 3.5% and 15% (at 5 bits 14% and 16%).
# - A convolution reads its input linearly into its weight's gradient, which the few active
#   samples carry: with only the BatchNorm inputs at 6 bits, the convolutions of layer3 and
#   layer4 (their inputs are ReLU outputs on 2x2 and 1x1 maps) kept 9-27% of their minibatch
#   variance over 300 steps.
# So every save of rank 4 or more with at most ``SMALL_MAP`` elements per channel (dimension 1)
# takes ``SMALL_MAP_EXTRA_BITS`` more than the level's width (6 at L1, 4 at L1.2), and the input
# of a BatchNorm on batch statistics of any rank with as few ``BATCH_NORM_EXTRA_BITS`` more (8 at
# L1, 6 at L1.2): with 2 more, at lr 0.1, a BatchNorm weight of layer3 still took 8.5% of its
# minibatch variance, with 8 bits 2.0% at the same weights (every small map at 7 bits did about
# as well, at the same cost). Over 300 steps and 3 seeds, rounding at L1 then adds at most 4.0%
# (lr 0.05) and 4.4% (lr 0.1) of the minibatch variance to any parameter's gradient of that
# ResNet, the minibatch variance taken over 32 batches (BENCHMARKS.md, "Stability"). At batch
# 64 the rule covers 31% of its quantized elements (layer2-4), the BatchNorm inputs among them
# 17%: L1 stores 6.25x less than fp32 instead of 7.56x without it. The examples' CNNs, whose
# maps hold 6,272 or more elements per channel at their batch size, are unchanged. Compiled
# graphs apply the same widths: ``SaveHooks._compress`` adds the small-map bits to every save,
# and a compiled site knows a BatchNorm's input from its forward graph, where it feeds the
# BatchNorm op or, decomposed by inductor, a ``var_mean`` over every dimension but the channels'
# (``CompiledSite.batch_norm_input`` in compiled_sites.py).
# At adaptive levels the extra bits are a *preferred* width (``SiteRecord.preferred_bits``),
# not a floor like fused attention's 6 bits: they reduce variance, not a bias, and an adaptive
# level promises its budget. The allocation gives those saves their preferred widths where
# the level's average (or ``memory_budget``) holds them, lowered a bit at a time where it does
# not, down to the hard lower bounds (NOTE [Preference tiers] in adapt.py; L2.2 on that ResNet
# gets the lower bounds: its preferred widths average 3.2 bits per element, metadata included);
# ``SaveHooks._compress`` applies a preferred width only to the saves no allocation has placed
# yet.
SMALL_MAP = 1024  # elements per channel at most
SMALL_MAP_EXTRA_BITS = 2  # bits above the level's
BATCH_NORM_EXTRA_BITS = 4  # bits above the level's, for a BatchNorm's input


def small_channels(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (rank 2 or more) holds at most ``SMALL_MAP`` elements per channel
    (dimension 1; NOTE [Small maps])."""
    return tensor.numel() // max(tensor.shape[1], 1) <= SMALL_MAP


def small_map_bits(tensor: torch.Tensor, nominal: int) -> int:
    """The width a save of ``tensor`` takes at least, where a level whose width is ``nominal``
    affords it: 2 more on small maps of rank 4 or more (NOTE [Small maps]), else 0."""
    if tensor.dim() < 4 or not small_channels(tensor):
        return 0
    return min(8, nominal + SMALL_MAP_EXTRA_BITS)


def _batch_norm(weight_at: int) -> _Rule:
    """Rule of ``F.batch_norm`` (its weight fourth) or ``torch.batch_norm`` (second)."""

    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        x = _arg(args, kwargs, 0, "input", None)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.numel():
            return None
        # both take ``training`` sixth and ``eps`` eighth (nn.BatchNorm passes True whenever
        # it normalises by the batch's statistics)
        if not _arg(args, kwargs, 5, "training", False):
            return None  # running statistics: a fixed affine map of the input
        use = None
        if measuring():
            weight = _arg(args, kwargs, weight_at, "weight", None)
            eps = float(_arg(args, kwargs, 7, "eps", 1e-5))
            use = BatchNormUse(x.numel(), weight if isinstance(weight, torch.Tensor) else None, eps)
        # its per-channel mean and reciprocal spread are kept, as LayerNorm's per-row ones, and
        # an input of rank 2 or 3 is grouped by channel, as those of rank 4 are
        channels, by_channel = x.shape[1], id(x) if x.dim() < 4 else None
        if not small_channels(x):
            return DecisionSpec(exact_numel=channels, channels_id=by_channel, batch_norm=use)
        return DecisionSpec(
            extra_bits=BATCH_NORM_EXTRA_BITS, precise_ids=frozenset({id(x)}),
            exact_numel=channels, channels_id=by_channel, batch_norm=use,
        )  # fmt: skip

    return rule


def _row_norm(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    x = _arg(args, kwargs, 0, "input", None)
    shape = _arg(args, kwargs, 1, "normalized_shape", None)
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(x, torch.Tensor) or not shape or x.numel() == 0:
        return None
    length = math.prod(int(n) for n in shape)
    return DecisionSpec(exact_numel=x.numel() // length, rows_id=id(x), row_length=length)


def _norm(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    order = _arg(args, kwargs, 1, "p", kwargs.get("ord", 2))
    return _EXACT if isinstance(order, (int, float)) and math.isinf(order) else None


def _parameter(value: Any) -> bool:
    """A leaf tensor whose gradient autograd accumulates (a parameter, cast inside the call
    under autocast)."""
    return isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is None


def _product(
    x_at: tuple[int, str],
    weight_at: tuple[int, str],
    *,
    matrix: bool,
    bias_at: tuple[int, str] | None = None,
) -> _Rule:
    """Rule of a call computing ``x W`` (rows of ``x``) with a parameter ``W`` at ``weight_at``
    (position, keyword), a matrix if ``matrix``, plus the bias at ``bias_at`` if any:
    ``F.linear``, ``addmm``, ``matmul``, ``mm``."""

    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        weight = _arg(args, kwargs, *weight_at, None)
        if not _parameter(weight) or (matrix and weight.dim() != 2):
            return None
        x = _arg(args, kwargs, *x_at, None)
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or not x.numel():
            return None
        bias = bias_at is not None and _parameter(_arg(args, kwargs, *bias_at, None))
        return DecisionSpec(linear=LinearUse(x.numel(), None, bias))

    return rule


def _conv(dims: int) -> _Rule:
    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        x, weight = _arg(args, kwargs, 0, "input", None), _arg(args, kwargs, 1, "weight", None)
        if not (_parameter(weight) and weight.dim() == dims + 2):
            return None
        if not isinstance(x, torch.Tensor) or x.dim() != dims + 2 or not x.numel():
            return None  # unbatched inputs: not measured

        def per_dim(value: Any) -> tuple[int, ...]:
            return tuple(value) if isinstance(value, (tuple, list)) else (int(value),) * dims

        kernel = tuple(weight.shape[2:])
        stride = per_dim(_arg(args, kwargs, 3, "stride", 1))
        dilation = per_dim(_arg(args, kwargs, 5, "dilation", 1))
        padding = _arg(args, kwargs, 4, "padding", 0)
        if padding == "valid":
            padding = 0
        elif padding == "same":  # symmetric only when every dilated kernel is odd-sized
            total = [d * (k - 1) for d, k in zip(dilation, kernel)]
            if any(t % 2 for t in total):
                return None
            padding = tuple(t // 2 for t in total)
        groups = int(_arg(args, kwargs, 6, "groups", 1))
        return DecisionSpec(
            linear=LinearUse(x.numel(), (stride, per_dim(padding), dilation, groups, kernel))
        )

    return rule


# NOTE [Shape-only saves]
# ``index_add`` and ``index_copy`` (``out.index_add_(dim, index, source)``, the aggregation of
# message passing in GNNs) save ``source``, whose gradient is ``grad.index_select(dim, index)``
# expanded to ``source``'s shape: the backward reads ``source.dim()`` and its sizes, never a
# value. So do ``put`` (its ``source``: ``grad.take(index)`` reshaped, and ``zeros_like`` of it),
# and ``gather`` and ``take_along_dim`` (their input, whose gradient scatters ``grad`` into
# zeros of its shape; ``take_along_dim`` saves a broadcast view of it, so a save of a view of
# the argument counts too), and max and average pooling (their input, for the gradient's shape
# and memory layout: max pooling scatters through the indices it saved; on CUDA the backward
# makes the input contiguous, one transient tensor of its size as its dequantization was; in a
# ResNet's stem the pooled ReLU output is then read by the ReLU alone, NOTE [Decision-only
# saves] in saved.py). Every floating-point save these calls make is one of those, which the
# tests check by reading NaNs in their place. Such a save (the index ops' messages are the
# GNN examples' largest activation, 0.4-3.4 MB a layer on Cora) is stored as its shape alone
# (``saved.SavedShape``, no bytes counted), so it is no item of the allocation: nothing to
# probe, whose rounding would have been found harmless only after probes. Its unpack is one
# NaN expanded to the shape, so a backward that ever read the values (another PyTorch's
# formula) would give NaNs, never plausible wrong numbers; ``tests/test_shape_only.py`` checks
# the gradients against fp32's bit for bit on this PyTorch.
# Another op saving the same tensor stores it as usual: a shape-only save never enters the
# table that shares one tensor's saves (NOTE [What autograd holds] in saved.py).
def _shape_only(position: int, name: str) -> _Rule:
    """Rule of a call whose backward reads its argument at ``(position, name)`` only for its
    shape (NOTE above)."""

    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        value = _arg(args, kwargs, position, name, None)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return None
        base = value._base  # a save of a view of it (whose ``_base`` is the same root)
        return DecisionSpec(shape_ids=frozenset({id(value), id(value if base is None else base)}))

    return rule


_Rule = Callable[[Sequence[Any], dict[str, Any]], "DecisionSpec | None"]


def _always(spec: DecisionSpec) -> _Rule:
    return lambda args, kwargs: spec


def _rules() -> dict[Callable[..., Any], _Rule]:
    positive = _always(_POSITIVE)
    relu = _always(_RELU)
    exact = _always(_EXACT)
    table: dict[Callable[..., Any], _Rule] = {}

    def add(rule: _Rule, *funcs: Any) -> None:
        for func in funcs:
            if func is not None:
                table[func] = rule

    T = torch.Tensor
    add(relu, F.relu, F.relu_, torch.relu, torch.relu_, T.relu, T.relu_)
    add(_always(_LEAKY), F.leaky_relu, F.leaky_relu_)
    # RReLU in training saves its random slopes too, which its backward multiplies by
    add(positive, F.rrelu, F.rrelu_, F.elu, F.elu_, F.selu, F.selu_, F.celu, F.celu_)
    add(positive, F.prelu, torch.selu, torch.celu)
    add(_hardtanh, F.hardtanh, F.hardtanh_)
    add(lambda a, k: _between(0.0, 6.0, low_strict=True, high_strict=True), F.relu6)
    add(lambda a, k: _between(-3.0, 3.0, low_strict=True, high_strict=True), F.hardsigmoid)
    # hardswish: zero below -3, linear up to 3 (inclusive), identity above
    add(lambda a, k: DecisionSpec(((False, -3.0), (True, 3.0))), F.hardswish)
    add(_threshold, F.threshold, F.threshold_, torch.threshold, torch.threshold_)
    add(_clamp, torch.clamp, torch.clip, T.clamp, T.clamp_, T.clip, T.clip_)
    add(_clamp_min, torch.clamp_min, T.clamp_min, T.clamp_min_)
    add(_clamp_max, torch.clamp_max, T.clamp_max, T.clamp_max_)
    abs_spec = DecisionSpec(((True, 0.0), (False, 0.0)), only_decisions=True)  # the sign
    add(_always(abs_spec), torch.abs, T.abs, T.abs_)
    add(_shrink, F.hardshrink, F.softshrink, T.hardshrink)
    add(_norm, torch.norm, T.norm, torch.linalg.vector_norm, torch.linalg.norm)
    add(exact, torch.maximum, torch.minimum, torch.fmax, torch.fmin, T.maximum, T.minimum)
    add(exact, torch.amax, torch.amin, T.amax, T.amin, torch.max, torch.min, T.max, T.min)
    add(exact, torch.median, T.median, torch.nanmedian, T.nanmedian)
    add(exact, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.hinge_embedding_loss)
    add(exact, F.margin_ranking_loss, F.triplet_margin_loss, F.multi_margin_loss)
    add(exact, F.multilabel_margin_loss)
    add(exact, torch.log, torch.log2, torch.log10, torch.log1p, T.log, T.log_, T.log2, T.log2_)
    add(exact, T.log10, T.log10_, T.log1p, T.log1p_, torch.sqrt, T.sqrt, T.sqrt_)
    add(exact, torch.rsqrt, T.rsqrt, T.rsqrt_, torch.prod, T.prod, torch.cumprod, T.cumprod)
    add(exact, T.cumprod_, torch.atan2, torch.arctan2, T.atan2, T.atan2_, T.arctan2, T.arctan2_)
    add(exact, torch.xlogy, T.xlogy, T.xlogy_, torch.special.xlogy, torch.special.xlog1py)
    add(exact, torch.cdist, torch.pdist, F.pdist, torch.dist, T.dist)
    add(_power, torch.pow, T.pow, T.pow_, T.__pow__, T.__ipow__, torch.float_power)
    add(_power, T.float_power, T.float_power_)
    # inverses, factorisations and spectra: their backwards solve with what they saved, or
    # divide by the gaps between its eigenvalues or singular values
    for name in _LINALG:
        add(exact, getattr(torch.linalg, name, None))
    for name in _INVERSES:
        add(exact, getattr(torch, name, None), getattr(T, name, None))
    add(_grid, F.grid_sample)
    add(_log_probabilities, F.log_softmax, torch.log_softmax, T.log_softmax, F.cross_entropy)
    # logsumexp: its backward reads exp(x - result), biased from rounded x (NOTE
    # [Log-probabilities])
    add(exact, torch.logsumexp, T.logsumexp, torch.special.logsumexp)
    add(_shape_only(0, "input"), F.nll_loss)  # reads its input for the shape of the gradient
    # Python composites DecisionMode sees as one call: what their inner calls decide or divide
    add(_normalize, F.normalize)
    add(_cosine_similarity, F.cosine_similarity, torch.cosine_similarity)
    add(_kept_input, F.softsign)  # x / (1 + |x|): abs decides inside, not the output's node
    add(exact, F.lp_pool1d, F.lp_pool2d, getattr(F, "lp_pool3d", None))  # sign, relu, x ** (1/p)
    add(_reduction(4), torch.scatter_reduce, T.scatter_reduce, T.scatter_reduce_)
    add(_reduction(4), torch.index_reduce, T.index_reduce, T.index_reduce_)
    add(_reduction(1), torch.segment_reduce)
    add(_divisor, torch.div, torch.divide, torch.true_divide, T.div, T.div_, T.divide, T.divide_)
    add(_divisor, T.true_divide, T.true_divide_, T.__truediv__, T.__itruediv__)
    add(_gelu, F.gelu)
    add(_silu, F.silu)
    add(_attention, F.scaled_dot_product_attention)
    add(_batch_norm(3), F.batch_norm)
    add(_batch_norm(1), torch.batch_norm)  # and aten's, which shares its name and schema
    add(_row_norm, F.layer_norm, torch.layer_norm)
    add(_row_norm, getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None))
    source = _shape_only(3, "source")
    add(source, torch.index_add, T.index_add, T.index_add_)
    add(source, torch.index_copy, T.index_copy, T.index_copy_)
    add(_shape_only(2, "source"), torch.put, T.put, T.put_)
    add(_shape_only(0, "input"), torch.take_along_dim, T.take_along_dim, torch.gather, T.gather)
    # max pooling scatters the gradient through the indices it saved, average pooling spreads
    # it over each window: either reads its input for the shape and layout of the gradient
    pooled = _shape_only(0, "input")
    for kind in ("max", "adaptive_max", "avg", "adaptive_avg"):
        for d in (1, 2, 3):
            add(
                pooled,
                getattr(F, f"{kind}_pool{d}d"),
                getattr(F, f"{kind}_pool{d}d_with_indices", None),
            )
    return table


def _meter_rules() -> dict[Callable[..., Any], _Rule]:
    """The rules of calls that read a save linearly into a parameter's gradient: they matter
    only while a sensitivity meter runs (NOTE [Measured sensitivities] in measured.py)."""
    T = torch.Tensor
    matmul = _product((0, "input"), (1, "other"), matrix=True)
    return {
        F.linear: _product((0, "input"), (1, "weight"), matrix=False, bias_at=(2, "bias")),
        **dict.fromkeys(
            (torch.addmm, T.addmm),
            _product((1, "mat1"), (2, "mat2"), matrix=True, bias_at=(0, "input")),
        ),
        **dict.fromkeys((torch.matmul, T.matmul, T.__matmul__), matmul),
        **dict.fromkeys((torch.mm, T.mm), _product((0, "input"), (1, "mat2"), matrix=True)),
        F.conv1d: _conv(1),
        F.conv2d: _conv(2),
        F.conv3d: _conv(3),
    }


def _by_aten_name(rules: dict[Callable[..., Any], _Rule]) -> dict[str, _Rule]:
    """``torch.ops.aten.<name>`` calls reach the mode as op overloads: matched by name. Their
    arguments follow the same schema as the Python functions."""
    return {
        name: rules[func] for func in rules if (name := getattr(func, "__name__", "").lstrip("_"))
    }


# Calls whose backward multiplies the gradient by one saved argument to give another argument's
# gradient (divisions too: ``a / b`` gives ``b`` the gradient ``-g a / b^2``): ``DecisionMode``
# publishes their arguments (NOTE [Products of a shared save] in live.py).
def _products() -> frozenset[Callable[..., Any]]:
    T = torch.Tensor
    funcs = [
        torch.mul, T.mul, T.mul_, T.__mul__, T.__rmul__, T.__imul__, torch.multiply, T.multiply,
        T.multiply_, torch.div, T.div, T.div_, T.__truediv__, T.__rtruediv__, T.__itruediv__,
        torch.divide, T.divide, T.divide_, torch.true_divide, T.true_divide, torch.matmul,
        T.matmul, T.__matmul__, T.__rmatmul__, torch.mm, T.mm, torch.bmm, T.bmm, torch.mv, T.mv,
        torch.dot, T.dot, torch.vdot, torch.inner, torch.outer, T.outer, torch.ger, torch.kron,
        torch.einsum, torch.tensordot, torch.addmm, T.addmm, T.addmm_, torch.addmv, T.addmv,
        torch.addr, T.addr, torch.baddbmm, T.baddbmm, T.baddbmm_, torch.addbmm, torch.addcmul,
        T.addcmul, T.addcmul_, torch.addcdiv, T.addcdiv, T.addcdiv_, torch.linalg.multi_dot,
        torch.linalg.vecdot, torch.cross, torch.linalg.cross, torch.linalg.matmul,
        torch.chain_matmul, torch.lerp, T.lerp, T.lerp_, F.linear, F.bilinear, F.conv1d,
        F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    ]  # fmt: skip
    return frozenset(f for f in funcs if f is not None)


PRODUCTS = _products()

_RULES, _METER_RULES = _rules(), _meter_rules()
_ATEN_RULES, _ATEN_METER_RULES = _by_aten_name(_RULES), _by_aten_name(_METER_RULES)
_meters: weakref.WeakSet[object] = weakref.WeakSet()  # running sensitivity meters


def measuring() -> bool:
    """Whether a sensitivity meter runs: calls that read a save linearly into a parameter's
    gradient then publish a ``LinearUse`` (NOTE [Measured sensitivities] in measured.py);
    otherwise they cost nothing here."""
    return bool(_meters)


def set_measuring(meter: object, on: bool) -> None:
    """``meter`` starts (``on``) or stops running; a meter nobody holds any more stops."""
    if on:
        _meters.add(meter)
    else:
        _meters.discard(meter)


# Every call of a forward passes through ``DecisionMode``, most of them (views, additions,
# matrix products while no meter runs) without a rule: the rule of each function, ``None``
# included, is looked up once and then read from a dictionary, one per meter state (one lookup
# per call).
_rule_of: tuple[dict[Callable[..., Any], _Rule | None], ...] = ({}, {})


def find_rule(func: Callable[..., Any], metering: bool) -> _Rule | None:
    """The rule of ``func``, with the meter rules if ``metering``."""
    known = _rule_of[metering]
    try:
        return known[func]
    except KeyError:
        pass
    aten = isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
    name = func.__name__.split(".")[0] if aten else None
    rule = _RULES.get(func) or _ATEN_RULES.get(name)
    if rule is None and metering:
        rule = _METER_RULES.get(func) or _ATEN_METER_RULES.get(name)
    known[func] = rule
    return rule
