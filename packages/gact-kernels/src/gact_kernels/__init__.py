"""gact-kernels: compression primitives for activation-compressed training (GACT).

Per-group stochastic-rounding quantisation to 1-8 bits and lossless 1-bit mask packing, on CPU
(OpenMP) and CUDA. The compiled code links no torch; torch tensors are handed to it by address.

Example:
    >>> import torch, gact_kernels
    >>> x = torch.randn(64, 256)
    >>> q = gact_kernels.quantize(x, 4, seed=1)
    >>> y = gact_kernels.dequantize(q)
    >>> y.shape == x.shape and y.dtype == x.dtype
    True
"""

from ._backend import CUDANotCompiledError, compiled_with_cuda
from .mask import PackedMask, pack_mask, unpack_mask
from .quantize import QuantizedTensor, dequantize, quantize

__all__ = [
    "CUDANotCompiledError",
    "PackedMask",
    "QuantizedTensor",
    "compiled_with_cuda",
    "dequantize",
    "pack_mask",
    "quantize",
    "unpack_mask",
]
__version__ = "0.1.0"
