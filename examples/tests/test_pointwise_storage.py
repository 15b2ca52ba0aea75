"""pointwise_storage.py's tables fitted on a tensor: the best bin-aligned intervals."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def _sse(f, xs, bounds):
    z = xs.double().requires_grad_(True)
    (d,) = torch.autograd.grad(f(z).sum(), z)
    piece = torch.bucketize(xs.double(), bounds)
    return sum(float(((d[piece == k] - d[piece == k].mean()) ** 2).sum()) for k in piece.unique())


def test_intervals_match_the_best_cuts_found_by_brute_force(script):
    module = script("pointwise_storage.py")
    torch.manual_seed(0)
    xs = torch.randn(4000)
    bins = 12
    bounds, levels = module.fit_intervals("gelu", xs, bits=2, bins=bins)
    assert bounds.numel() == 3 and levels.numel() == 4
    assert torch.all(bounds[1:] > bounds[:-1])
    # the same bin edges as the programme's, every choice of 3 inner cuts among them
    edges = torch.quantile(xs.double(), torch.linspace(0, 1, bins + 1)[1:-1].double())
    best = min(
        _sse(F.gelu, xs, edges[list(cuts)]) for cuts in itertools.combinations(range(bins - 1), 3)
    )
    assert abs(_sse(F.gelu, xs, bounds) - best) <= 1e-9 * max(1.0, best)


def test_levels_are_the_mean_derivative_of_each_interval(script):
    module = script("pointwise_storage.py")
    torch.manual_seed(1)
    xs = torch.randn(2000)
    bounds, levels = module.fit_intervals("silu", xs, bits=1, bins=32)
    d = module.derivative("silu", xs)
    piece = torch.bucketize(xs.double(), bounds)
    for k in range(2):
        assert torch.isclose(levels[k], d[piece == k].mean())


def test_more_bits_never_fit_worse_and_beat_one_piece(script):
    module = script("pointwise_storage.py")
    torch.manual_seed(2)
    xs = 2 * torch.randn(3000)
    one_piece = _sse(F.gelu, xs, torch.empty(0, dtype=torch.float64))
    errors = [_sse(F.gelu, xs, module.fit_intervals("gelu", xs, b, bins=64)[0]) for b in (1, 2, 3)]
    assert errors[0] < one_piece and errors[1] <= errors[0] and errors[2] <= errors[1]
