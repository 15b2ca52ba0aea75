"""Shared helpers for the gact-kernels tests."""

from __future__ import annotations

import gact_kernels
import pytest
import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not gact_kernels.compiled_with_cuda(),
    reason="needs a CUDA device and the gact_kernels._cuda module",
)


def step_per_element(q: gact_kernels.QuantizedTensor) -> torch.Tensor:
    """The quantisation step of each element's group, from the stored metadata (flat, fp32)."""
    return q.scale.repeat_interleave(q.group_size)[: q.numel]


def assert_within_one_step(x: torch.Tensor, q: gact_kernels.QuantizedTensor) -> None:
    """|dequantize(q) - x| <= one step of the element's group (+ the final dtype rounding)."""
    y = gact_kernels.dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    xf, yf = x.reshape(-1).double(), y.reshape(-1).double()
    step = step_per_element(q).double().to(xf.device)
    eps = torch.finfo(x.dtype).eps
    bound = step * (1 + 1e-6) + yf.abs() * eps + 1e-30
    finite = torch.isfinite(step)
    err = (yf - xf).abs()
    assert bool((err[finite] <= bound[finite]).all()), float((err - bound)[finite].max())
    lossless = ~finite
    torch.testing.assert_close(yf[lossless], xf[lossless], rtol=0, atol=0, equal_nan=True)
