"""The compressed containers: copying, pickling, saving, validation and ``decompress``."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
from typing import Callable

import gact_kernels
import pytest
import torch
from kernels_testing import bits_equal

Maker = Callable[[], gact_kernels.Compressed]


def _quantized() -> gact_kernels.QuantizedTensor:
    x = torch.randn(3, 700).bfloat16()
    x[0, 5] = float("nan")  # one lossless group, so every buffer is non-empty
    return gact_kernels.quantize(x, 3, group_size=64, seed=2**63 + 5)


def _quantized_zero_exact() -> gact_kernels.QuantizedTensor:
    x = torch.randn(3, 700).relu()
    x[1, 5] = float("inf")
    return gact_kernels.quantize(x, 2, group_size=64, seed=7, zero_exact=True)


def _mask() -> gact_kernels.PackedMask:
    return gact_kernels.pack_mask(
        torch.rand(4, 8, 5, 5).to(memory_format=torch.channels_last) > 0.5
    )


def _ints() -> gact_kernels.PackedInts:
    return gact_kernels.pack_ints(torch.randint(-(2**40), 2**40, (33, 17)).t())


MAKERS = {
    "quantized": _quantized,
    "quantized_zero_exact": _quantized_zero_exact,
    "mask": _mask,
    "ints": _ints,
}


@pytest.fixture(params=sorted(MAKERS))
def container(request: pytest.FixtureRequest) -> gact_kernels.Compressed:
    return MAKERS[request.param]()


def _torch_round_trip(c: gact_kernels.Compressed) -> gact_kernels.Compressed:
    buffer = io.BytesIO()
    torch.save(c, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "clone",
    [copy.copy, copy.deepcopy, lambda c: pickle.loads(pickle.dumps(c)), _torch_round_trip],
    ids=["copy", "deepcopy", "pickle", "torch.save"],
)
def test_copy_pickle_save_round_trip(container: gact_kernels.Compressed, clone) -> None:
    other = clone(container)
    assert type(other) is type(container) and other == container
    assert bits_equal(gact_kernels.decompress(other), gact_kernels.decompress(container))


def test_deepcopy_owns_its_buffers(container: gact_kernels.Compressed) -> None:
    other = copy.deepcopy(container)
    for a, b in zip(container.buffers(), other.buffers()):
        assert a.numel() == 0 or a.data_ptr() != b.data_ptr()


def test_equality_and_hash(container: gact_kernels.Compressed) -> None:
    assert container == dataclasses.replace(container)
    changed = container.buffers()[0].clone()
    changed.view(-1)[:1] ^= 1
    name = container._BUFFERS[0]
    assert container != dataclasses.replace(container, **{name: changed})
    assert container != object()
    with pytest.raises(TypeError, match="unhashable"):
        hash(container)


def test_compressed_is_the_common_base_and_decompress_dispatches() -> None:
    x = torch.randn(10, 30)
    m = torch.rand(10, 30) > 0.5
    i = torch.randint(0, 9, (10, 30), dtype=torch.int16)
    q, p, k = gact_kernels.quantize(x, 8), gact_kernels.pack_mask(m), gact_kernels.pack_ints(i)
    assert all(isinstance(c, gact_kernels.Compressed) for c in (q, p, k))
    assert bits_equal(gact_kernels.decompress(q), gact_kernels.dequantize(q))
    assert torch.equal(gact_kernels.decompress(p), m)
    assert torch.equal(gact_kernels.decompress(k), i)
    with pytest.raises(TypeError, match=r"c must be a gact_kernels\.Compressed container"):
        gact_kernels.decompress(x)


def test_repr_is_short(container: gact_kernels.Compressed) -> None:
    text = repr(container)
    assert text.startswith(type(container).__name__ + "(") and "nbytes=" in text
    assert "tensor(" not in text


# --- validation: every field is checked against the payload before the kernels see it ---------


def test_wrong_shape_is_rejected_not_a_segfault() -> None:
    q = gact_kernels.quantize(torch.randn(1000), 4)
    with pytest.raises(ValueError, match=r"QuantizedTensor\.data must have shape"):
        dataclasses.replace(q, shape=torch.Size([1 << 26]), stride=(1,))
    p = gact_kernels.pack_mask(torch.ones(100, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"PackedMask\.data must have shape \(1250,\)"):
        dataclasses.replace(p, shape=torch.Size([10_000]), stride=(1,))


@pytest.mark.parametrize(
    "field,value,error,message",
    [
        ("data", lambda q: q.data[:-1], ValueError, r"QuantizedTensor\.data must have shape"),
        ("data", lambda q: q.data.to(torch.int32), TypeError, r"data must be a dense torch\.uint8"),
        ("data", lambda q: torch.stack([q.data, q.data], 1)[:, 0], ValueError, "contiguous"),
        ("data", lambda q: q.data.tolist(), TypeError, r"data must be a torch\.Tensor, got list"),
        ("lo", lambda q: q.lo.double(), TypeError, r"lo must be a dense torch\.float32"),
        ("scale", lambda q: q.scale[:1], ValueError, r"scale must have shape \(4,\)"),
        ("dtype", lambda q: torch.float64, ValueError, r"dtype must be one of float32, float16"),
        ("dtype", lambda q: "float32", TypeError, r"dtype must be a torch\.dtype"),
        ("bits", lambda q: 9, ValueError, r"QuantizedTensor\.bits must be one of 1, 2"),
        ("group_size", lambda q: 100, ValueError, r"QuantizedTensor\.group_size must be a mult"),
        ("seed", lambda q: -1, ValueError, r"QuantizedTensor\.seed must be an int in"),
        ("zero_exact", lambda q: 1, TypeError, r"QuantizedTensor\.zero_exact must be a bool"),
        ("shape", lambda q: (10, 100), TypeError, r"QuantizedTensor\.shape must be a torch\.Size"),
        ("stride", lambda q: [100, 1], TypeError, r"QuantizedTensor\.stride must be a tuple of 2"),
        ("stride", lambda q: (1, 1), ValueError, r"does not lay shape \(10, 100\) out densely"),
        ("stride", lambda q: (100, -1), ValueError, "must not be negative"),
        ("lossless_values", lambda q: q.lossless_values.float(), TypeError, "bfloat16"),
    ],
)
def test_bad_field_names_the_field(field, value, error, message) -> None:
    q = gact_kernels.quantize(torch.randn(10, 100).bfloat16(), 2)
    with pytest.raises(error, match=message):
        dataclasses.replace(q, **{field: value(q)})


def test_buffers_resized_in_place_are_caught_before_the_kernel() -> None:
    q = gact_kernels.quantize(torch.randn(5000), 4)
    q.data.resize_(10)
    with pytest.raises(ValueError, match=r"resized in place"):
        gact_kernels.dequantize(q)
    p = gact_kernels.pack_ints(torch.arange(5000))
    p.mins.resize_(1)
    with pytest.raises(ValueError, match=r"PackedInts\.mins must have shape"):
        gact_kernels.unpack_ints(p)


def test_tampered_int_widths_are_caught_on_cpu() -> None:
    p = gact_kernels.pack_ints(torch.arange(1000))
    wide = p.widths.clone()
    wide[0] = 65
    with pytest.raises(ValueError, match=r"widths must lie in 0\.\.64"):
        gact_kernels.unpack_ints(dataclasses.replace(p, widths=wide))
    narrow = p.widths.clone()
    narrow[0] -= 1
    with pytest.raises(ValueError, match="the widths describe"):
        gact_kernels.unpack_ints(dataclasses.replace(p, widths=narrow))


def test_out_of_range_lossless_indices_are_clamped() -> None:
    x = torch.randn(600)
    x[1] = float("inf")
    q = gact_kernels.quantize(x, 4)
    bad = dataclasses.replace(q, lossless_groups=torch.tensor([-(2**40)]))
    assert gact_kernels.dequantize(bad).shape == x.shape  # no out-of-bounds write


def test_mixed_devices_rejected() -> None:
    q = gact_kernels.quantize(torch.randn(100), 4)
    meta = torch.empty(q.lo.shape, dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match=r"QuantizedTensor\.lo is on meta"):
        dataclasses.replace(q, lo=meta)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: gact_kernels.quantize(s, 4),
        lambda s: gact_kernels.pack_mask(s.bool()),
        lambda s: gact_kernels.pack_ints(s.long()),
    ],
    ids=["quantize", "pack_mask", "pack_ints"],
)
def test_sparse_inputs_get_a_clear_message(call) -> None:
    sparse = torch.eye(4).to_sparse()
    with pytest.raises(ValueError, match=r"layout torch\.sparse_coo is not supported.*to_dense"):
        call(sparse)


# --- the compressing functions' own containers skip validation: they must pass it -------------
_SHAPES = [(0,), (7,), (3, 700), (5, 0, 3), (4, 6, 3, 3), (2, 512, 1, 1), (2, 3, 16, 16)]


@pytest.mark.parametrize("shape", _SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_built_containers_pass_validation(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    # NOTE [container invariants]: quantize, pack_mask and pack_ints build their containers
    # without re-validating them; every layout and option must still give a valid one
    gen = torch.Generator().manual_seed(len(shape) * 31 + sum(shape))
    x = torch.randn(shape, generator=gen).to(dtype)
    if x.numel():
        x.view(-1)[0] = float("nan")  # a lossless group
    views = [x, x.transpose(0, -1), x[..., ::2]]
    if x.dim() == 4:
        views.append(x.to(memory_format=torch.channels_last))
    made: list[gact_kernels.Compressed] = []
    for v in views:
        for bits in range(1, 9):
            made.append(gact_kernels.quantize(v, bits, group_size=64, seed=bits))
            if bits >= 2:
                made.append(gact_kernels.quantize(v.abs(), bits, zero_exact=True))
            if v.dim() == 4 and v.numel():
                made.append(gact_kernels.quantize(v, bits, group_size=32, channel_dim=1))
        made.append(gact_kernels.pack_mask(v > 0))
        made.append(gact_kernels.pack_ints((v.float().nan_to_num() * 100).to(torch.int32)))
    for c in made:
        c._validate()
        assert c == dataclasses.replace(c)  # the validating constructor accepts it unchanged
