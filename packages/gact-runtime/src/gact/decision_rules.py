"""The rule of each function whose backward branches on a saved tensor, or reads it through more
than a linear formula: the ``DecisionSpec`` of a call from its arguments (NOTE [Exact
decisions] in decisions.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import attention, linear_rules, norm_rules
from .decision_spec import EXACT, DecisionSpec, Rule, argument

__all__ = ["find_rule"]

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


_POSITIVE = DecisionSpec(((True, 0.0),))  # ELU and the like also read the value below 0
_LEAKY = DecisionSpec(_POSITIVE.predicates, only_decisions=True)  # reads only the sign
_RELU = DecisionSpec(_POSITIVE.predicates, zero_exact=True, only_decisions=True)


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
            return EXACT
        preds.append((strict, t))
    return DecisionSpec(tuple(preds), only_decisions=True)


def _hardtanh(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    low = argument(args, kwargs, 1, "min_val", -1.0)
    high = argument(args, kwargs, 2, "max_val", 1.0)
    return _between(low, high, low_strict=True, high_strict=True)


def _clamp(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    low = argument(args, kwargs, 1, "min", None)
    high = argument(args, kwargs, 2, "max", None)
    return _between(low, high, low_strict=False, high_strict=False)


def _clamp_min(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    return _between(
        argument(args, kwargs, 1, "min", None), None, low_strict=False, high_strict=False
    )


def _clamp_max(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    return _between(
        None, argument(args, kwargs, 1, "max", None), low_strict=False, high_strict=False
    )


def _threshold(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    low = argument(args, kwargs, 1, "threshold", None)
    return _between(low, None, low_strict=True, high_strict=False)


def _shrink(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    lambd = _scalar(argument(args, kwargs, 1, "lambd", 0.5))
    if lambd is None:
        return EXACT
    # the gradient is zero where -lambd <= x <= lambd
    return DecisionSpec(((False, -lambd), (True, lambd)), only_decisions=True)


def _divisor(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    other = argument(args, kwargs, 1, "other", None)
    return (
        DecisionSpec(exact_ids=frozenset({id(other)})) if isinstance(other, torch.Tensor) else None
    )


_EXACT_REDUCE = frozenset({"amax", "amin", "max", "min", "prod"})


def _reduction(position: int) -> Rule:
    """Rule of a scatter, index or segment reduction whose ``reduce`` argument is at
    ``position``: a maximum or minimum shares the gradient among the values equal to the
    result, a product divides by them (NOTE [Exact decisions]); a sum or mean reads nothing."""

    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        return EXACT if argument(args, kwargs, position, "reduce", None) in _EXACT_REDUCE else None

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
    grid = argument(args, kwargs, 1, "grid", None)
    return DecisionSpec(exact_ids=frozenset({id(grid)})) if isinstance(grid, torch.Tensor) else None


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
# its gradient was 1.6 off, relative norm). The saves stored as probabilities are the
# ``log_softmax`` output and views of it (``cross_entropy`` saves one for ``nll_loss2d``), told
# by their autograd node: ``cross_entropy``'s other saves (soft targets, the smoothed target it
# computes for ``label_smoothing``, ``nll_loss``'s 0-d total weight) are no log-probabilities.
# Stored as ``exp`` of themselves, a smoothed target's rounding was biased, and a total weight
# of 128 became ``exp(128) = inf`` (with ``min_numel=0``): every gradient came out 0.
_LOG_SOFTMAX = DecisionSpec(log_softmax=True)


def _cross_entropy(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    """``F.cross_entropy``: its log-softmax output stored as probabilities (NOTE above), but
    for soft targets that require grad (mutual learning, a trained teacher): the target's
    gradient reads that output linearly, which ``log`` of a rounded probability biases, and
    the softmax's backward through ``exp``, which rounding it in the log domain biases. One
    stored tensor serves neither read unbiasedly: the call's saves are kept (before, the
    target's gradient, stored as probabilities, stayed 1.0 off, relative norm, over 24
    seeds)."""
    target = argument(args, kwargs, 1, "target", None)
    if isinstance(target, torch.Tensor) and target.is_floating_point() and target.requires_grad:
        return EXACT
    return _LOG_SOFTMAX


def _kept_input(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    """A composite whose inner call decides on its input: the input is kept (exact masks are
    read by the output's backward node only, NOTE [Exact decisions])."""
    x = argument(args, kwargs, 0, "input", None)
    return DecisionSpec(exact_ids=frozenset({id(x)})) if isinstance(x, torch.Tensor) else None


def _power(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    """``x ** p``: its backward's ``x ** (p - 1)`` is unbounded near 0 for ``p < 1`` (and a
    tensor exponent's reads ``log x``); a number raised to a tensor reads only the output."""
    if not isinstance(argument(args, kwargs, 0, "input", None), torch.Tensor):
        return None
    p = _scalar(argument(args, kwargs, 1, "exponent", None))
    return None if p is not None and (p >= 1 or p == 0) else EXACT


def _gelu(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    approximate = argument(args, kwargs, 1, "approximate", "none")
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    x = argument(args, kwargs, 0, "input", None)
    if name is None or not isinstance(x, torch.Tensor):
        return None
    return DecisionSpec(derivative=name, derivative_id=id(x))


def _silu(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    x = argument(args, kwargs, 0, "input", None)
    if argument(args, kwargs, 1, "inplace", False) or not isinstance(x, torch.Tensor):
        return None  # in place, the saved tensor is the output's storage
    return DecisionSpec(derivative="silu", derivative_id=id(x))


def _norm(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    order = argument(args, kwargs, 1, "p", kwargs.get("ord", 2))
    return EXACT if isinstance(order, (int, float)) and math.isinf(order) else None


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
def _shape_only(position: int, name: str) -> Rule:
    """Rule of a call whose backward reads its argument at ``(position, name)`` only for its
    shape (NOTE above)."""

    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        value = argument(args, kwargs, position, name, None)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return None
        base = value._base  # a save of a view of it (whose ``_base`` is the same root)
        return DecisionSpec(shape_ids=frozenset({id(value), id(value if base is None else base)}))

    return rule


def _always(spec: DecisionSpec) -> Rule:
    return lambda args, kwargs: spec


def _rules() -> dict[Callable[..., Any], Rule]:
    positive = _always(_POSITIVE)
    relu = _always(_RELU)
    exact = _always(EXACT)
    table: dict[Callable[..., Any], Rule] = {}

    def add(rule: Rule, *funcs: Any) -> None:
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
    add(_always(_LOG_SOFTMAX), F.log_softmax, torch.log_softmax, T.log_softmax)
    add(_cross_entropy, F.cross_entropy)
    # logsumexp: its backward reads exp(x - result), biased from rounded x (NOTE
    # [Log-probabilities])
    add(exact, torch.logsumexp, T.logsumexp, torch.special.logsumexp)
    add(_shape_only(0, "input"), F.nll_loss)  # reads its input for the shape of the gradient
    # Python composites DecisionMode sees as one call: what their inner calls decide or divide
    add(norm_rules.normalize, F.normalize)
    add(norm_rules.cosine_similarity, F.cosine_similarity, torch.cosine_similarity)
    add(_kept_input, F.softsign)  # x / (1 + |x|): abs decides inside, not the output's node
    add(exact, F.lp_pool1d, F.lp_pool2d, getattr(F, "lp_pool3d", None))  # sign, relu, x ** (1/p)
    add(_reduction(4), torch.scatter_reduce, T.scatter_reduce, T.scatter_reduce_)
    add(_reduction(4), torch.index_reduce, T.index_reduce, T.index_reduce_)
    add(_reduction(1), torch.segment_reduce)
    add(_divisor, torch.div, torch.divide, torch.true_divide, T.div, T.div_, T.divide, T.divide_)
    add(_divisor, T.true_divide, T.true_divide_, T.__truediv__, T.__itruediv__)
    add(_gelu, F.gelu)
    add(_silu, F.silu)
    add(attention.rule, F.scaled_dot_product_attention)
    add(norm_rules.batch_norm(3), F.batch_norm)
    add(norm_rules.batch_norm(1), torch.batch_norm)  # and aten's, which shares its name and schema
    add(norm_rules.row_norm, F.layer_norm, torch.layer_norm)
    add(norm_rules.row_norm, getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None))
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


def _by_aten_name(rules: dict[Callable[..., Any], Rule]) -> dict[str, Rule]:
    """``torch.ops.aten.<name>`` calls reach the mode as op overloads: matched by name. Their
    arguments follow the same schema as the Python functions."""
    return {
        name: rules[func] for func in rules if (name := getattr(func, "__name__", "").lstrip("_"))
    }


_RULES, _METER_RULES = _rules(), linear_rules.meter_rules()
_ATEN_RULES, _ATEN_METER_RULES = _by_aten_name(_RULES), _by_aten_name(_METER_RULES)
# Every call of a forward passes through ``DecisionMode``, most of them (views, additions,
# matrix products while no meter runs) without a rule: the rule of each function, ``None``
# included, is looked up once and then read from a dictionary, one per meter state (one lookup
# per call).
_rule_of: tuple[dict[Callable[..., Any], Rule | None], ...] = ({}, {})


def find_rule(func: Callable[..., Any], metering: bool) -> Rule | None:
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
