"""The rules of normalisations: BatchNorm on batch statistics (and the widths of small maps),
LayerNorm and RMSNorm, and composites dividing rows by their norms (NOTE [Attention and row
normalisations] in decision_rules.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from . import linear_rules
from .decision_spec import EXACT, BatchNormUse, DecisionSpec, Rule, argument

__all__ = [
    "BATCH_NORM_EXTRA_BITS", "SMALL_MAP", "SMALL_MAP_EXTRA_BITS", "batch_norm",
    "cosine_similarity", "normalize", "row_norm", "small_channels", "small_map_bits",
]  # fmt: skip

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


def batch_norm(weight_at: int) -> Rule:
    """Rule of ``F.batch_norm`` (its weight fourth) or ``torch.batch_norm`` (second)."""

    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        x = argument(args, kwargs, 0, "input", None)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.numel():
            return None
        # both take ``training`` sixth and ``eps`` eighth (nn.BatchNorm passes True whenever
        # it normalises by the batch's statistics)
        if not argument(args, kwargs, 5, "training", False):
            return None  # running statistics: a fixed affine map of the input
        use = None
        if linear_rules.measuring():
            weight = argument(args, kwargs, weight_at, "weight", None)
            eps = float(argument(args, kwargs, 7, "eps", 1e-5))
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


def row_norm(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    x = argument(args, kwargs, 0, "input", None)
    shape = argument(args, kwargs, 1, "normalized_shape", None)
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(x, torch.Tensor) or not shape or x.numel() == 0:
        return None
    length = math.prod(int(n) for n in shape)
    return DecisionSpec(exact_numel=x.numel() // length, rows_id=id(x), row_length=length)


def _rows(x: Any, dim: Any, *, grouped: bool) -> DecisionSpec:
    """Spec of a call dividing the rows of ``x`` along ``dim`` by their norms: its saves of one
    value per row (the norms, a clamp's decision, the divisor) are kept; ``grouped``: ``x``'s
    save is grouped by rows where they are contiguous, as LayerNorm's (NOTE [Attention and row
    normalisations] in decision_rules.py)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not isinstance(dim, int):
        return EXACT
    length = x.shape[dim]
    rows = x.numel() // max(length, 1)
    if not grouped or dim % x.dim() != x.dim() - 1:
        return DecisionSpec(exact_numel=rows)
    return DecisionSpec(exact_numel=rows, rows_id=id(x), row_length=length)


def normalize(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    """``F.normalize``, a Python composite ``DecisionMode`` sees as one call."""
    x, dim = argument(args, kwargs, 0, "input", None), argument(args, kwargs, 2, "dim", 1)
    return _rows(x, dim, grouped=True)


def cosine_similarity(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec:
    """``F.cosine_similarity``, a C++ composite: only its rows' norms are read nonlinearly."""
    x, dim = argument(args, kwargs, 0, "x1", None), argument(args, kwargs, 2, "dim", 1)
    return _rows(x, dim, grouped=False)
