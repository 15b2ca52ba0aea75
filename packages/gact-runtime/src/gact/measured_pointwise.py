"""Sensitivities of GELU and SiLU inputs measured in an ordinary backward, up to the linear layer
that produced them (NOTE [Measured pointwise inputs])."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

from .decision_spec import LinearUse
from .measured_norms import _SLICES, _fp32
from .pointwise import SECOND_DERIVATIVES

__all__ = ["Curved", "Rows"]

# NOTE [Measured pointwise inputs]
# The backward of GELU or SiLU reads its saved input ``x`` only through ``f'(x)``: rounding
# ``x`` to ``x + ε`` changes the input's gradient ``g f'(x)`` by ``e = g f''(x) ε`` to first
# order. Where a measured linear layer produced ``x`` from rows ``u_r`` (the first layer of a
# transformer's MLP), ``e`` reaches that layer's weight gradient ``e^T u`` and its bias's
# ``Σ_r e_r``, which err, with independent zero-mean ``ε``, by
#
#     E‖e^T u‖² + E‖Σ_r e_r‖² = Σ_r (‖u_r‖² + 1) Σ_j g_rj² f''(x_rj)² Var ε_rj
#
# (no ``+ 1`` without a trainable bias). So a measured linear call keeps ``‖u_r‖² (+ 1)`` per
# row when it returns (one number per row, on measuring steps only); at the function's save of
# that output (same object, same version) the meter forms ``m_rj = (‖u_r‖² + 1) f''(x_rj)²
# Var ε_rj`` and sums it over each sample's rows: the positions of one index of the first
# dimension (a sequence's tokens), or blocks of up to 8 rows of a 2-D input. ``Var ε`` is read,
# as in NOTE [Measured sensitivities], off a throwaway 8-bit quantization in the layout of a
# quantized save (``TRIAL_BITS``; the save itself may be a derivative table), one slice of the
# batch at a time: these inputs are a transformer's
# largest, and reading the whole one at once (its values, steps and ``f''``) raised a measuring
# step's forward peak on the char-GPT memory configuration from 212 to 241 MiB. In the
# backward a hook on the function's output reads ``g`` and weighs each sample's column sums by
# the mean of ``g²`` over the same rows. Exact per element, it would hold a tensor of ``x``'s
# size until the backward; on the BERT example's GELU inputs the sums were 0.86-1.10 of the
# exact term. Left out:
# - second-order terms (the squared bias of a GELU input's rounding is at most 0.05 of its
#   variance at 4 bits on the BERT and char-GPT examples, 0.07-2.6 at 2 bits,
#   ``diagnose_adaptation.py``);
# - the error that the producer's input gradient ``e W`` carries further back. Rounding one
#   GELU input of the BERT example at a time (4 bits, 8 seeds), the term was 0.97-1.02 of the
#   error of the producer's weight and bias, and their error was 0.50-0.52 of the error of every
#   parameter's gradient at initialisation, 0.19-0.54 after 300 steps (the last layer's the
#   least). So the term is scaled by ``FURTHER_BACK`` = 2, what those measurements put on the
#   rest of the model: 0.31-1.09 of the true effect on that model's GELU inputs, 0.39-0.85 on
#   char-GPT's, where the probes it replaces were 50-115x off; 0.37-0.84 on a LLaMA-style
#   decoder's SiLU inputs, where the probes happened to be closer (BENCHMARKS.md, "Measured
#   GELU inputs").
# A function whose input no measured linear layer made (a convolution's output, a residual
# sum, a product) is probed.
FURTHER_BACK = 2.0
_BLOCK_ROWS = 8  # rows per block of a 2-D input (at most)
_SLICE_ELEMENTS = 1 << 18  # elements per slice at least (NOTE [Batch slices]: at most _SLICES)


class Rows:
    """What a GELU or SiLU reading a measured linear call's output needs of that call (NOTE
    [Measured pointwise inputs]), taken when it returns: the output (weakly), its version and
    ``‖u_r‖²`` per row of the call's input (``‖u_r‖² + 1`` if the call adds a trainable
    bias)."""

    __slots__ = ("norms", "output", "version")

    def __init__(self, out: torch.Tensor, norms: torch.Tensor) -> None:
        self.output, self.version, self.norms = weakref.ref(out), out._version, norms

    @classmethod
    def of(cls, out: torch.Tensor, source: torch.Tensor, use: LinearUse) -> Rows | None:
        """The rows of ``out = source W^T`` (``None`` for a convolution, or if their rows do
        not pair up: ``source`` may be the flattened view a product saves)."""
        if use.conv is not None or not out.numel() or not source.numel():
            return None
        if out.numel() // out.shape[-1] != source.numel() // source.shape[-1]:
            return None
        with torch.no_grad(), _fp32(out):
            norms = torch.linalg.vector_norm(source.detach(), dim=-1, dtype=torch.float32)
            norms = norms.square_().view(-1)
        return cls(out, norms.add_(1.0) if use.bias else norms)

    def curved(
        self, x: torch.Tensor, function: str, variance: Callable[[torch.Tensor], torch.Tensor]
    ) -> Curved:
        """What the term of ``function``'s input ``x`` (this call's output) needs from the
        forward; ``variance(part)``: the per-element rounding variance of a part of ``x`` (a
        throwaway quantization), taken over slices of an eighth of its blocks, of at least
        ``_SLICE_ELEMENTS`` elements (NOTE [Batch slices] in measured_norms.py), so that its
        temporaries stay small."""
        shape = _blocks(x)
        blocks = x.detach().reshape(shape)
        norms = self.norms.view(*shape[:2], 1)
        per = max(-(-shape[0] // _SLICES), -(-_SLICE_ELEMENTS // (shape[1] * shape[2])))
        masses = []
        with torch.no_grad(), _fp32(x):
            for part, weights in zip(blocks.split(per), norms.split(per)):
                mass = variance(part).mul_(SECOND_DERIVATIVES[function](part.float()).square_())
                masses.append(mass.mul_(weights).sum(1))
        return Curved(torch.cat(masses), shape)


class Curved:
    """A measured GELU or SiLU input's forward quantities (NOTE [Measured pointwise inputs]):
    ``mass``, ``Σ ‖u_r‖² f''(x_rj)² Var ε_rj`` per block of rows and column, and ``shape``, the
    input viewed as (blocks, rows per block, columns)."""

    __slots__ = ("mass", "shape")

    def __init__(self, mass: torch.Tensor, shape: tuple[int, int, int]) -> None:
        self.mass, self.shape = mass, shape

    def term(self, g: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        """The key's term for the output gradient ``g`` (``weight``: unused, a BatchNorm's);
        ``None`` if the shapes disagree."""
        if g.numel() != math.prod(self.shape) or g.shape[-1] != self.shape[2]:
            return None
        with _fp32(g):
            square = g.reshape(self.shape).float().square().sum(1)
            return square.mul_(self.mass).sum().mul_(FURTHER_BACK / self.shape[1])


def _blocks(x: torch.Tensor) -> tuple[int, int, int]:
    """``x`` (not empty, rank 1 or more) as (blocks, rows per block, columns): a block per index
    of the first dimension if ``x`` has 3 or more, else blocks of the most rows up to
    ``_BLOCK_ROWS`` that divide them."""
    columns = x.shape[-1]
    rows = x.numel() // columns
    if x.dim() >= 3:
        per = rows // x.shape[0]
    else:
        per = next(k for k in range(min(_BLOCK_ROWS, rows), 0, -1) if rows % k == 0)
    return rows // per, per, columns
