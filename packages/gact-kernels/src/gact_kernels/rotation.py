"""Blockwise randomized Hadamard rotation of float tensors, and its inverse."""

from __future__ import annotations

import torch

from ._backend import DTYPE_CODES, launch
from ._checks import check_dtype, check_seed, check_tensor, integer
from ._layout import empty_with_layout, flat_view, memory_order
from .quantize import FLOAT_DTYPES

__all__ = ["MAX_ROTATION_BLOCK", "rotate", "unrotate"]

#: Largest rotation block :func:`rotate` and :func:`unrotate` accept (a CUDA block holds one
#: in shared memory).
MAX_ROTATION_BLOCK = 4096


def _check_block(block: object) -> int:
    value = integer(block, "block")
    if value < 2 or value > MAX_ROTATION_BLOCK or value & (value - 1):
        raise ValueError(
            f"block must be a power of two in [2, {MAX_ROTATION_BLOCK}]; got {value}: a "
            "quantization group of size G takes blocks dividing G"
        )
    return value


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """``H (s * x)`` per block of ``block`` consecutive elements (memory order), in float32.

    ``H`` is the ``block x block`` Sylvester-Hadamard matrix and ``s`` a fixed pseudo-random
    +-1 vector (NOTE [storage and RNG invariants] in csrc/common.h gives both and the order of
    the additions, so the CPU and CUDA results are the same bits). The rotation preserves the
    squared norm up to the factor ``block`` and spreads a few large elements over their block,
    so a rotated block's range, and the step of a grid spanning it, shrink when the block is
    heavy-tailed. Elements after the last whole block are copied. :func:`unrotate` inverts it.
    A dense ``x`` (any permutation of dimensions) is read in place and the result gets its
    strides; other layouts are copied contiguous first. Asynchronous on CUDA.

    Args:
        x: float32, float16 or bfloat16 tensor on CPU or CUDA.
        block: a power of two in ``[2, MAX_ROTATION_BLOCK]``.

    Returns:
        A float32 tensor of ``x``'s shape.

    Raises:
        TypeError: ``x`` is not a tensor, ``block`` not an int.
        ValueError: an unsupported dtype or device, or a ``block`` out of range.

    Example:
        >>> import torch, gact_kernels
        >>> x = torch.zeros(8); x[3] = 8.0  # one spike
        >>> gact_kernels.rotate(x, 8).abs().tolist()  # spread over the block
        [8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0, 8.0]
    """
    check_tensor(x, "x", FLOAT_DTYPES)
    block = _check_block(block)
    flat, stride = memory_order(x.detach())
    out = empty_with_layout(x.shape, stride, torch.float32, x.device)
    n = flat.numel()
    if n:
        launch(
            "rotate", x.device, flat.data_ptr(), DTYPE_CODES[x.dtype], n, block,
            flat_view(out).data_ptr(),
        )  # fmt: skip
    return out


def unrotate(
    y: torch.Tensor, block: int, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.Tensor:
    """The inverse of :func:`rotate`: ``s * (H y) / block`` per block, in ``dtype``.

    A float16 or bfloat16 result is rounded stochastically (unbiased, from ``seed``, as
    :func:`dequantize` rounds its output), so that a rotated, quantized and unrotated tensor
    stays unbiased; float32 is rounded to nearest. Elements after the last whole block are only
    converted. Layout and asynchrony as :func:`rotate`.

    Args:
        y: float32 tensor on CPU or CUDA.
        block: the block ``y`` was rotated with.
        dtype: float32, float16 or bfloat16.
        seed: seed of the stochastic rounding, in ``[0, 2**64)``.

    Returns:
        A tensor of ``y``'s shape and ``dtype``.

    Raises:
        TypeError: ``y`` is not a tensor, ``dtype`` not a dtype, ``block`` or ``seed`` not an
            int.
        ValueError: ``y`` not float32, an unsupported device or ``dtype``, or a ``block`` or
            ``seed`` out of range.

    Example:
        >>> import torch, gact_kernels
        >>> x = torch.randn(1000)
        >>> back = gact_kernels.unrotate(gact_kernels.rotate(x, 256), 256)
        >>> bool(torch.allclose(back, x, atol=1e-5))
        True
    """
    check_tensor(y, "y", (torch.float32,))
    block = _check_block(block)
    check_dtype(dtype, FLOAT_DTYPES, "dtype")
    seed = check_seed(seed)
    flat, stride = memory_order(y.detach())
    out = empty_with_layout(y.shape, stride, dtype, y.device)
    n = flat.numel()
    if n:
        launch(
            "unrotate", y.device, flat.data_ptr(), n, block, seed, DTYPE_CODES[dtype],
            flat_view(out).data_ptr(),
        )  # fmt: skip
    return out
