"""gact-kernels: compression primitives for activation-compressed training (GACT).

Per-group stochastic-rounding quantisation of float tensors to 1-8 bits, lossless 1-bit mask
packing, lossless integer packing, uint8 bucket codes and blockwise Hadamard rotations, on CPU
(OpenMP) and CUDA. Every
compressed container is a :class:`Compressed`; :func:`decompress` restores any of them with its
shape, strides, dtype and device. The compiled code links no torch; torch tensors are handed to it by address.

Example:
    >>> import torch, gact_kernels
    >>> x = torch.randn(64, 256)
    >>> q = gact_kernels.quantize(x, 4, seed=1)
    >>> y = gact_kernels.decompress(q)
    >>> y.shape == x.shape and y.dtype == x.dtype and y.stride() == x.stride()
    True
"""

import torch

from ._backend import CUDANotCompiledError, compiled_with_cuda
from ._checks import MAX_GROUP_SIZE
from ._compressed import Compressed, decompress
from .buckets import MAX_BOUNDARIES, bucketize
from .ints import INT_DTYPES, PackedInts, pack_ints, unpack_ints
from .mask import MASK_DTYPES, PackedMask, pack_mask, unpack_mask
from .pending import PendingQuantize
from .quantize import (
    FLOAT_DTYPES,
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_async,
    rounding_steps,
)
from .rotation import MAX_ROTATION_BLOCK, rotate, unrotate

__all__ = [
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "MASK_DTYPES",
    "MAX_BOUNDARIES",
    "MAX_GROUP_SIZE",
    "MAX_ROTATION_BLOCK",
    "CUDANotCompiledError",
    "Compressed",
    "PackedInts",
    "PackedMask",
    "PendingQuantize",
    "QuantizedTensor",
    "bucketize",
    "compiled_with_cuda",
    "decompress",
    "dequantize",
    "pack_ints",
    "pack_mask",
    "quantize",
    "quantize_async",
    "rotate",
    "rounding_steps",
    "unpack_ints",
    "unpack_mask",
    "unrotate",
]
__version__ = "0.1.0"

# The containers rebuild themselves through their validating constructors when unpickled, so
# torch.load(..., weights_only=True) may construct them (torch >= 2.4 has the allowlist).
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([PackedInts, PackedMask, QuantizedTensor])
