"""Rotated groups: heavy-tailed saves quantized after a randomized Hadamard rotation.

See NOTE [Rotated groups].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gact_kernels
import torch

__all__ = ["WORTH", "Rotated", "rotate", "rotation_is_better"]

_ROUND_SALT = 0x5EED_0F_0A_7C0DE  # the restoring rounding's stream, apart from the codes'

# NOTE [Rotated groups]
# A group's grid spans its range, so one large element sets the step of all the others: on the
# LLaMA-style decoder the input of the MLP's down projection, the SwiGLU product
# silu(gate) * up, is heavy-tailed (kurtosis 50-65 after 300 steps), and its weight gradient's
# rounding variance was 12-18% of the minibatch variance at 4 bits, above the paper's premise,
# where every other linear input stayed below 10% (BENCHMARKS.md, "Rotated groups").
#
# Such a tensor is quantized as y = H (s * x) per block of B elements (B the largest power of
# two dividing the group size, at most 256, so blocks never straddle groups), where H is the
# B x B Sylvester-Hadamard matrix (H H = B I) and s a fixed pseudo-random +-1 vector, and
# restored as x^ = s * H y^ / B (gact_kernels.rotate and unrotate). The rotation is orthogonal
# up to the factor B: the rounding error keeps its squared norm and stays unbiased (E[y^] = y,
# and the restoration is linear), but a few large elements are spread over their block, so
# its range, and the step, shrink. The signs keep a constant block from becoming one spike.
# Rules that keep this exact:
# - the kernels rotate by additions and subtractions in float32 (a fast Walsh-Hadamard
#   transform, the same bits on the CPU and CUDA; no matrix product, which TF32 would round):
#   a deterministic error at float32's precision, as any float32 computation has. A float16
#   or bfloat16 tensor is restored in float32 and rounded to its type stochastically
#   (unbiased, as the kernels' dequantized output is);
# - a non-finite element would turn its whole block into NaN: a tensor with one (or whose
#   rotation overflows) is quantized unrotated, chosen on the device (``finite``) without a
#   synchronisation, and only converted back to its type (that step's gradient is not finite
#   anyway);
# - which tensors rotate is judged per save-site key from up to 64 groups, by the expected
#   squared error of stochastic rounding in both forms (it predicts the weight gradient's
#   rounding variance within 16% on the decoder's linear inputs), at the same times as a
#   derivative table's (NOTE [Derivative tables] in pointwise.py). Rotating costs a transform at
#   each pack and unpack, so only a clear gain counts: rotated error below WORTH times the
#   plain one. On the decoder the down projections' inputs rotate (0.16-0.19x), no other linear
#   input does (rotated, their error would be 1.2-2.1x the plain one's);
# - a measured sensitivity (NOTE [Measured sensitivities] in measured.py) reads the rounding
#   variance d (s - d) of each element of the rotated form, against the tensor rotated again,
#   and spreads each block's sum over the block, 1 / B**2 each (H's entries are +-1): the
#   restored errors are then uncorrelated but for the unequal variances within a block. Read
#   against the unrotated tensor, it was thousands of times too large, and L2.2 on the decoder
#   gave the down projections' inputs the bits the rest needed (a final loss of 2.60 against
#   2.31 unrotated, seed 1). A key an allocation keeps at full precision is measured through a
#   plain 8-bit trial: for a tensor that would rotate, its sensitivity is overestimated (up to
#   5x), which costs bytes, not accuracy;
# - groups that never span two rows or channels (NOTE [Attention and row normalisations],
#   NOTE [channel groups]), the zero-exact grid, derivative tables and non-contiguous tensors
#   are never rotated: each has its own layout or grid that a rotation would undo.
WORTH = 0.5


def _block_size(group_size: int) -> int:
    """The rotation's block: the largest power of two dividing ``group_size``, at most 256
    (``gact_kernels.rotate``'s blocks must not straddle two groups)."""
    return min(group_size & -group_size, 256)


@dataclass(frozen=True)
class Rotated:
    """How a rotated save is restored: its block, whether it was finite (a 0-d bool tensor on
    its device: if not, its payload holds it unrotated), its type, shape and strides (those of
    a contiguous tensor but on dimensions of size 1), and the seed of the stochastic rounding
    back to a narrower type."""

    block: int
    finite: torch.Tensor
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    seed: int

    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """The tensor from the dequantized float32 ``values`` of its rotated form."""
        # a non-finite tensor was stored unrotated: its step's gradient is not finite anyway,
        # so its values are only converted
        back = _select(
            self.finite,
            lambda: gact_kernels.unrotate(values, self.block, dtype=self.dtype, seed=self.seed),
            lambda: values.to(self.dtype),
        )
        return back.as_strided(self.shape, self.stride)  # as saved: unpacked_stride() tells

    def held_form(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the one saved) in the form its payload holds, float32: rotated, or as it
        is where it was not finite."""
        return _select(
            self.finite, lambda: gact_kernels.rotate(tensor, self.block), lambda: tensor.float()
        )

    def spread(self, variance: torch.Tensor) -> torch.Tensor:
        """Per element of the tensor, the variance of its restored value, from the independent
        per-element rounding ``variance`` of its held form: the restoration ``s * H y / B``
        gives each element of a block ``1 / B**2`` of the block's summed variance (``H``'s
        entries are +-1); the tail, and a tensor held unrotated, keep theirs."""

        def spread_blocks() -> torch.Tensor:
            flat = variance.reshape(-1).clone()
            whole = flat.numel() - flat.numel() % self.block
            head = flat[:whole].view(-1, self.block)
            flat[:whole] = (head.sum(1, keepdim=True) / self.block**2).expand_as(head).reshape(-1)
            return flat.view(variance.shape)

        return _select(self.finite, spread_blocks, lambda: variance)


def rotate(data: torch.Tensor, *, group_size: int, seed: int) -> tuple[torch.Tensor, Rotated]:
    """The float32 rotated form of contiguous ``data`` to quantize in groups of ``group_size``
    (``data`` itself, in float32, if it holds a non-finite element or its rotation overflows)
    and how to restore it."""
    block = _block_size(group_size)
    rotated = gact_kernels.rotate(data, block)
    finite = torch.isfinite(rotated.sum())  # a non-finite element spoils its block's sums
    source = _select(finite, lambda: rotated, lambda: data.float())
    return source, Rotated(block, finite, data.dtype, data.shape, data.stride(), seed ^ _ROUND_SALT)


def _select(
    condition: torch.Tensor,
    if_true: Callable[[], torch.Tensor],
    if_false: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """``if_true()`` where the 0-d bool ``condition`` holds, else ``if_false()``: on a GPU both,
    chosen by ``torch.where`` without a synchronisation; elsewhere the one needed."""
    if condition.is_cuda:
        return torch.where(condition, if_true(), if_false())
    return if_true() if bool(condition) else if_false()


def _expected_error(groups: torch.Tensor, bits: int) -> float:
    """Expected squared error of ``bits``-bit stochastic rounding of each row of ``groups`` on
    the grid spanning its range: ``step**2 * p * (1 - p)`` per element."""
    lo, hi = groups.amin(1, keepdim=True), groups.amax(1, keepdim=True)
    step = (hi - lo) / (2**bits - 1)
    safe = torch.where(step > 0, step, torch.ones_like(step))
    t = (groups - lo) / safe
    p = t - torch.floor(t)
    return float((safe**2 * p * (1 - p)).sum())


def rotation_is_better(
    data: torch.Tensor,
    bits: int,
    *,
    group_size: int,
    feature_dim: int | None = None,
    max_groups: int = 64,
) -> bool:
    """Whether rotating contiguous ``data`` cuts the expected squared rounding error per element
    at ``bits`` below ``WORTH`` times that of its layout unrotated (groups in memory order, or
    along ``feature_dim``, the last dimension: NOTE [Feature groups] in storing.py), judged on up
    to ``max_groups`` whole groups of each spread over it (non-finite ones: no)."""
    flat = data.detach().reshape(-1)
    groups = flat.numel() // group_size
    if groups == 0:
        return False
    sample = _spread(flat.view(1, -1), groups, group_size, max_groups)
    if feature_dim is None:
        plain = sample
    else:  # rows of one feature: (features, rows) -> groups along the rows, at most all of them
        columns = data.detach().reshape(-1, data.shape[-1]).t()
        along = min(group_size, columns.shape[1])
        plain = _spread(columns, columns.shape[1] // along, along, max_groups)
    if plain.numel() == 0 or not bool(torch.isfinite(sample).all() & torch.isfinite(plain).all()):
        return False
    block = _block_size(group_size)
    spun = gact_kernels.rotate(sample, block).double()
    # the restoration divides by the block: squared errors shrink by it
    rotated = _expected_error(spun, bits) / block / sample.numel()
    return rotated < WORTH * _expected_error(plain.double(), bits) / plain.numel()


def _spread(rows: torch.Tensor, per_row: int, group_size: int, max_groups: int) -> torch.Tensor:
    """Up to ``max_groups`` whole groups of ``group_size`` consecutive elements of the rows of
    ``rows`` (``per_row`` groups each), spread over them, as float32 rows."""
    total = rows.shape[0] * per_row
    if total == 0:
        return rows.new_empty((0, group_size), dtype=torch.float32)
    picked = torch.linspace(0, total - 1, min(total, max_groups), device=rows.device).long()
    row, block = picked // per_row, picked % per_row
    idx = block.unsqueeze(1) * group_size + torch.arange(group_size, device=rows.device)
    return rows[row.unsqueeze(1), idx].float()
