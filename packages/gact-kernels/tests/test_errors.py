"""Invalid arguments raise TypeError/ValueError naming the argument and the accepted values."""

from __future__ import annotations

import gact_kernels
import pytest
import torch
from gact_kernels import _backend


@pytest.mark.parametrize("bits", [0, 9, -1])
def test_bits_out_of_range(bits: int) -> None:
    with pytest.raises(ValueError, match=r"bits must be one of 1, 2, 3, 4, 5, 6, 7, 8; got"):
        gact_kernels.quantize(torch.randn(10), bits)


@pytest.mark.parametrize("bits", [2.0, "4", None, True])
def test_bits_not_int(bits: object) -> None:
    with pytest.raises(TypeError, match="bits must be an int"):
        gact_kernels.quantize(torch.randn(10), bits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool, torch.complex64])
def test_wrong_dtype(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=r"x: dtype .* accepted: float32, float16, bfloat16"):
        gact_kernels.quantize(torch.zeros(10, dtype=dtype), 4)


@pytest.mark.parametrize("group_size", [0, -8, 12, 100, 2**16 + 8])
def test_wrong_group_size(group_size: int) -> None:
    with pytest.raises(ValueError, match="group_size must be a multiple of 8 between 8 and 65536"):
        gact_kernels.quantize(torch.randn(10), 4, group_size=group_size)


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seed_out_of_range(seed: int) -> None:
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        gact_kernels.quantize(torch.randn(10), 4, seed=seed)


def test_non_tensor_inputs() -> None:
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor, got list"):
        gact_kernels.quantize([1.0, 2.0], 4)
    with pytest.raises(TypeError, match=r"mask must be a torch\.Tensor, got ndarray"):
        gact_kernels.pack_mask(torch.ones(3).numpy())
    with pytest.raises(TypeError, match="q must be a QuantizedTensor, got Tensor"):
        gact_kernels.dequantize(torch.ones(3))
    with pytest.raises(TypeError, match="p must be a PackedMask, got QuantizedTensor"):
        gact_kernels.unpack_mask(gact_kernels.quantize(torch.ones(3), 2))
    with pytest.raises(TypeError, match="p must be a PackedInts, got Tensor"):
        gact_kernels.unpack_ints(torch.ones(3))


def test_mask_wrong_dtype() -> None:
    with pytest.raises(ValueError, match=r"mask: dtype torch\.float32 .* accepted: bool, uint8"):
        gact_kernels.pack_mask(torch.ones(3))


def test_unsupported_device() -> None:
    with pytest.raises(
        ValueError, match="x: device meta is not supported; accepted devices: cpu, cuda"
    ):
        gact_kernels.quantize(torch.empty(10, device="meta"), 4)


def test_cuda_tensor_on_cpu_only_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_backend, "_cuda", None)
    assert not gact_kernels.compiled_with_cuda()
    with pytest.raises(gact_kernels.CUDANotCompiledError, match="GACT_KERNELS_CUDA=ON"):
        _backend.require_device(torch.device("cuda", 0), "x")
    assert issubclass(gact_kernels.CUDANotCompiledError, RuntimeError)


def test_public_api() -> None:
    assert sorted(gact_kernels.__all__) == [
        "CUDANotCompiledError",
        "Compressed",
        "FLOAT_DTYPES",
        "INT_DTYPES",
        "MASK_DTYPES",
        "MAX_BOUNDARIES",
        "MAX_GROUP_SIZE",
        "MAX_ROTATION_BLOCK",
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
    assert all(hasattr(gact_kernels, name) for name in gact_kernels.__all__)


def test_exported_facts() -> None:
    assert gact_kernels.MAX_GROUP_SIZE == 65536
    assert gact_kernels.FLOAT_DTYPES == (torch.float32, torch.float16, torch.bfloat16)
    assert gact_kernels.MASK_DTYPES == (torch.bool, torch.uint8)
    assert set(gact_kernels.INT_DTYPES) == {
        torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64
    }  # fmt: skip
    gact_kernels.quantize(torch.ones(8), 1, group_size=gact_kernels.MAX_GROUP_SIZE)
    with pytest.raises(ValueError, match="group_size"):
        gact_kernels.quantize(torch.ones(8), 1, group_size=gact_kernels.MAX_GROUP_SIZE + 8)
