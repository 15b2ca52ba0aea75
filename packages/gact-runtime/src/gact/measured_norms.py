"""Sensitivities of BatchNorm inputs measured in an ordinary backward, up to the layer that
produced them (NOTE [Measured BatchNorm inputs])."""

from __future__ import annotations

import weakref

import gact_kernels
import torch
from torch import nn

from .decision_spec import BatchNormUse, LinearUse

__all__ = ["Normalised", "Producer", "has_batch_norm"]

# NOTE [Measured BatchNorm inputs]
# A BatchNorm on batch statistics normalises ``x`` by its channel's mean ``μ`` and ``σ`` (exact,
# computed in the forward) and its backward reads the rounded ``x + ε``: over the ``M`` elements
# of a channel, with ``D = Σ g (x - μ)`` and ``E = Σ g ε``,
#
#     grad γ = Σ g (x - μ) / σ                                  errs by  E / σ
#     grad x = γ/σ (g - mean g - (x - μ) D / (M σ²))            errs by  -k (ε D + (x - μ) E)
#
# to first order, ``k = γ / (M σ³)``. The input gradient's error reaches every earlier layer,
# first the weight of the layer that produced ``x``. Where that producer is a measured linear
# layer or convolution with input ``u`` (``u_i``: the window output element ``i`` reads), its
# weight's gradient errs by ``-k (D Σ ε_i u_i + E H)``, ``H = Σ (x - μ) u`` being that
# weight's gradient for the output gradient ``x - μ``. With independent zero-mean ``ε``:
#
#     E‖Δ‖² = Σ_channels  w Σ g² Var ε  +  k² D² Σ Var ε_i ‖u_i‖²  (+ a cross term)
#     w = 1/σ² (if γ trains) + k² ‖H‖²
#
# So when a measured linear layer or convolution returns, while its input is alive, the meter
# keeps of it the output's channel means and variances, ``‖H‖²`` per channel (``Σ x u - μ Σ u``:
# no centred copy) and the squared norm of every input window (small: one number per sample,
# group and position), on measuring steps only; at a BatchNorm's save of that output (same
# object, same version) it computes ``w``, ``k²`` and ``Σ Var ε_i ‖u_i‖²`` per channel, and in
# the backward a hook on the BatchNorm's node reads ``g`` and, from its weight's gradient
# ``Σ g (x̂ - μ) / σ``, ``D`` (a frozen or absent weight: from the stored values). ``Σ g² Var ε``
# is taken per sample and channel as ``Σ g² · Σ Var ε / P`` over its ``P`` positions (one number
# per sample and channel waits for the backward, not a tensor). Left out: the cross term
# ``2 k² D Σ Var ε_i g_i (u_i · H)``, which needs a tensor in the backward (the measurement was
# 0.95-1.03 of the truth on single layers, ``test_measured.py``), and whatever the producer's
# own input gradient carries further back: the term is the error of ``γ`` and of the
# producer's weight. Once trained a little that is most of the effect: on the ResNet-18
# layout's 20 BatchNorm inputs after 50 and 200 steps (``examples/diagnose_adaptation.py
# --model resnet18``, two runs), 0.62-1.45 of the true effect on every parameter, median
# 0.93-0.95, rank correlation 0.98-1.00; at initialisation, where the error spreads further
# back, 0.01-1.31 (median 0.17; BENCHMARKS.md, "Measured BatchNorm inputs"). A BatchNorm
# whose input no measured producer made (a residual sum, an activation, a producer whose input
# is kept below ``min_numel``) is probed, and so is every BatchNorm input of a model holding
# no BatchNorm module (``has_batch_norm``: ``F.batch_norm`` called directly), whose meter keeps
# no producer's quantities.


def has_batch_norm(model: nn.Module) -> bool:
    """Whether ``model`` holds a BatchNorm module (whose inputs a meter may measure)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class Producer:
    """What a BatchNorm reading a measured call's output needs of that call (NOTE [Measured
    BatchNorm inputs]), taken when it returns, while its input is alive: the output (weakly)
    and its version, its channels' means and variances, ``‖H‖²`` per channel and the squared
    norm of each input window (per sample, group and output position; per row for a linear
    layer)."""

    __slots__ = ("groups", "hnorm", "mean", "norms", "output", "var", "version")

    def __init__(
        self,
        out: torch.Tensor,
        mean: torch.Tensor,
        var: torch.Tensor,
        hnorm: torch.Tensor,
        norms: torch.Tensor,
        groups: int,
    ) -> None:
        self.output, self.version = weakref.ref(out), out._version
        self.mean, self.var, self.hnorm, self.norms, self.groups = mean, var, hnorm, norms, groups

    @classmethod
    def of(cls, out: torch.Tensor, source: torch.Tensor, use: LinearUse) -> Producer | None:
        """The producer ``out = f(source)`` (``None`` for a linear layer whose output is not
        2-D: its channels are not a BatchNorm's). ``H = Σ (x - μ) u`` is computed as
        ``Σ x u - μ Σ u``, which takes no centred copy of the output."""
        conv = use.conv
        if conv is None and (out.dim() != 2 or source.dim() != 2):
            return None
        with torch.no_grad(), _fp32(out):
            x, u = out.detach().float(), source.detach().float()
            mean, var = _channel_moments(x)
            if conv is None:
                h = (x.T @ u).sub_(mean.view(-1, 1) * u.sum(0))
                norms, groups = torch.linalg.vector_norm(u, dim=1).square_(), 1
            else:
                stride, padding, dilation, groups, kernel = conv
                shape = (x.shape[1], u.shape[1] // groups, *kernel)
                options = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
                weight_grad = _WEIGHT_GRADIENT[len(kernel)]
                sums = weight_grad(
                    u.sum(0, keepdim=True), shape, x.new_ones((1, *x.shape[1:])), **options
                )  # Σ u over every window, per output channel
                h = weight_grad(u, shape, x, **options)
                h.sub_(sums.mul_(mean.view(-1, *[1] * (h.dim() - 1))))
                squares = torch.cat(
                    [
                        s.reshape(len(s), groups, -1, *u.shape[2:]).square().sum(2)
                        for s in _slices(u)
                    ]
                )  # per sample, group and position: Σ u² over the group's channels
                ones = u.new_ones((groups, 1, *kernel))
                norms = _CONVOLUTION[len(kernel)](squares, ones, **options)
            hnorm = h.flatten(1).square().sum(1)
        return cls(out, mean, var, hnorm, norms, groups)

    def normalised(
        self,
        x: torch.Tensor,
        use: BatchNormUse,
        payload: gact_kernels.QuantizedTensor,
        variance: torch.Tensor,
    ) -> Normalised:
        """What the term of the BatchNorm input ``x`` (this call's output) stored as
        ``payload``, with per-element rounding variance ``variance``, needs from the forward."""
        variance = variance.float()
        with _fp32(x):
            invstd = self.var.add(use.eps).rsqrt_()
            m = x.numel() // x.shape[1]
            gamma = use.weight
            k2 = invstd.pow(6).div_(m * m)  # (γ / (M σ³))²
            if gamma is not None:
                k2.mul_(gamma.detach().float().square())
            weights = self.hnorm * k2
            trains = gamma is not None and gamma.requires_grad
            if trains:
                weights.add_(invstd.square())
            spread = self.window_norms(variance).mul_(k2)
            mass = variance.reshape(*x.shape[:2], -1).sum(2)
            return Normalised(mass, weights, spread, invstd if trains else None, self.mean, payload)

    def window_norms(self, variance: torch.Tensor) -> torch.Tensor:
        """Per output channel, ``Σ Var ε_i ‖u_i‖²`` for the output's rounding ``variance``."""
        if self.norms.dim() == 1:  # rows of a linear layer
            return self.norms @ variance
        n, channels = variance.shape[:2]
        per_group = variance.reshape(n, self.groups, channels // self.groups, -1)
        norms = self.norms.reshape(n, self.groups, -1, 1)
        return torch.matmul(per_group, norms).sum(0).flatten()  # no copy of the variance


class Normalised:
    """A measured BatchNorm input's forward quantities (NOTE [Measured BatchNorm inputs]):
    ``mass``, its rounding variance per sample and channel; per channel ``weights`` (``w``),
    ``spread`` (``k² Σ Var ε_i ‖u_i‖²``) and ``invstd`` (``1/σ``, where the weight's gradient
    gives ``D``; ``None``: ``D`` is read off the stored ``payload`` and the channels' ``mean``)."""

    __slots__ = ("invstd", "mass", "mean", "payload", "spread", "weights")

    def __init__(
        self,
        mass: torch.Tensor,
        weights: torch.Tensor,
        spread: torch.Tensor,
        invstd: torch.Tensor | None,
        mean: torch.Tensor,
        payload: gact_kernels.QuantizedTensor,
    ) -> None:
        self.mass, self.weights, self.spread, self.invstd = mass, weights, spread, invstd
        self.mean, self.payload = mean, payload

    def term(self, g: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor | None:
        """The key's term for the output gradient ``g`` and the weight's gradient ``weight``
        (``Σ g (x̂ - μ) / σ``, from the stored values); ``None`` if the shapes disagree."""
        if tuple(g.shape[: self.mass.dim()]) != tuple(self.mass.shape):
            return None
        with _fp32(g):
            rows = g.reshape(*self.mass.shape, -1)
            square = torch.linalg.vector_norm(rows, dim=2, dtype=torch.float32).square_()
            term = square.mul_(self.mass).mv(self.weights).sum() / rows.shape[2]
            if self.invstd is not None and weight is not None:
                d = weight.float() / self.invstd
            else:  # no weight's gradient: from the stored values
                stored = gact_kernels.decompress(self.payload).view(g.shape).float()
                d = stored.sub_(self.mean).mul_(g).sum([0, *range(2, g.dim())])
            return term + d.square_().dot(self.spread)


def _fp32(t: torch.Tensor) -> torch.autocast:
    """No autocast on ``t``'s device: the meter's products are fp32 whatever the step runs in
    (under a bf16 autocast the producer's ``H`` came out in bf16)."""
    return torch.autocast(t.device.type, enabled=False)


# NOTE [Batch slices]
# Reductions over a tensor's batch and positions that keep its channels (``var_mean`` over
# dimensions 0, 2, 3; ``vector_norm`` over dimension 1) run 16-30x slower on the CPU than an
# elementwise square and a sum over the trailing dimensions (3.6 and 7.3 ms against 0.2 ms for
# 128 x 16 x 28 x 28 on 2 threads), and the fast form needs a temporary of the tensor's size,
# which would raise a measuring step's peak. So they run over slices of the batch, each an
# eighth of it: the temporaries take an eighth of the memory, at the fast form's speed.
_SLICES = 8


def _slices(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``x`` split along its batch into at most ``_SLICES`` slices (NOTE [Batch slices])."""
    return x.split(max(1, -(-x.shape[0] // _SLICES)))


def _channel_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean (shaped to broadcast against ``x``) and the variance of each channel
    (dimension 1) of ``x``, over its batch and positions (NOTE [Batch slices])."""
    dims = [0, *range(2, x.dim())]
    count = x.numel() // x.shape[1]
    mean = x.sum(dims, keepdim=True).div_(count)
    var = sum((s - mean).square_().sum(dims) for s in _slices(x))
    return mean, var.div_(count)


_CONVOLUTION = {
    1: torch.nn.functional.conv1d,
    2: torch.nn.functional.conv2d,
    3: torch.nn.functional.conv3d,
}
_WEIGHT_GRADIENT = {
    1: torch.nn.grad.conv1d_weight,
    2: torch.nn.grad.conv2d_weight,
    3: torch.nn.grad.conv3d_weight,
}
