"""Helpers shared by the gact-kernels tests (imported as a module, never via conftest)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import gact_kernels
import pytest
import torch

__all__ = [
    "DTYPES",
    "PACKING_PATHS",
    "assert_within_one_step",
    "bits_equal",
    "expected_nbytes",
    "memory_flat",
    "packing_path",
    "requires_cuda",
    "requires_vbmi",
    "step_per_element",
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not gact_kernels.compiled_with_cuda(),
    reason="needs a CUDA device and the gact_kernels._cuda module",
)


#: The CPU kernels' two ways of packing codes (NOTE [odd widths] in csrc/cpu_pack.h).
PACKING_PATHS = ("vbmi", "portable")

requires_vbmi = pytest.mark.skipif(
    not gact_kernels._cpu.vbmi_supported(), reason="needs a CPU with AVX-512 VBMI"
)


@contextlib.contextmanager
def packing_path(path: str) -> Iterator[None]:
    """Runs the CPU kernels on one packing path (skips the test where the CPU lacks VBMI)."""
    if path == "vbmi" and not gact_kernels._cpu.vbmi_supported():
        pytest.skip("this CPU has no AVX-512 VBMI")
    before = gact_kernels._cpu.use_vbmi(path == "vbmi")
    try:
        yield
    finally:
        gact_kernels._cpu.use_vbmi(before)


def expected_nbytes(n: int, bits: int, group_size: int, lossless: int, elem: int) -> int:
    """``QuantizedTensor.nbytes`` for n elements with `lossless` losslessly stored groups."""
    return (
        math.ceil(n * bits / 8) + 8 * math.ceil(n / group_size) + lossless * (8 + group_size * elem)
    )


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of values and layout (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def step_per_element(q: gact_kernels.QuantizedTensor) -> torch.Tensor:
    """The quantisation step of each element's group, in memory order (flat, fp32)."""
    return q.scale.repeat_interleave(q.group_size)[: q.numel]


def memory_flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order."""
    return t.as_strided((t.numel(),), (1,))


def assert_within_one_step(x: torch.Tensor, q: gact_kernels.QuantizedTensor) -> None:
    """|dequantize(q) - x| <= one step of the element's group plus one unit of the output grid
    (stochastic rounding to float16/bfloat16 moves a level by less than one unit)."""
    y = gact_kernels.dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    xf, yf = x.reshape(-1).double(), y.reshape(-1).double()
    step = step_per_element(q).double().to(xf.device)
    if y.stride() == x.stride():  # a dense input, restored with its strides: memory order
        xf, yf = memory_flat(x).double(), memory_flat(y).double()
    finfo = torch.finfo(x.dtype)
    unit = 2 * finfo.eps * torch.maximum(xf.abs(), yf.abs()) + finfo.tiny * finfo.eps
    bound = step * (1 + 1e-6) + unit + 1e-30
    finite = torch.isfinite(step)
    err = (yf - xf).abs()
    assert bool((err[finite] <= bound[finite]).all()), float((err - bound)[finite].max())
    lossless = ~finite
    torch.testing.assert_close(yf[lossless], xf[lossless], rtol=0, atol=0, equal_nan=True)
