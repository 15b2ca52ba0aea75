"""``rounding_steps``: each element's grid step, in the layout of its container."""

from __future__ import annotations

import gact_kernels
import pytest
import torch
from kernels_testing import memory_flat, step_per_element


def _variance(x: torch.Tensor, q: gact_kernels.QuantizedTensor) -> torch.Tensor:
    """``d (s - d)`` per element, with ``d = |x̂ - x|`` and ``s`` the element's step."""
    d = (gact_kernels.dequantize(q).double() - x.double()).abs()
    return d * (gact_kernels.rounding_steps(q).double() - d)


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_memory_order_groups_give_their_scale(bits: int) -> None:
    x = torch.randn(5, 300) * torch.logspace(-3, 3, 300)  # groups of very different ranges
    q = gact_kernels.quantize(x, bits, group_size=64, seed=3)
    steps = gact_kernels.rounding_steps(q)
    assert steps.shape == x.shape and steps.dtype == torch.float32
    torch.testing.assert_close(memory_flat(steps), step_per_element(q), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "layout",
    [
        lambda t: t,
        lambda t: t.contiguous(memory_format=torch.channels_last),
        lambda t: t[:, :, ::2],  # not dense
    ],
    ids=["contiguous", "channels_last", "strided"],
)
@pytest.mark.parametrize("zero_exact", [False, True])
@pytest.mark.parametrize("channel_dim", [None, 1])
def test_the_rounding_variance_is_the_same_whichever_way_an_element_went(
    layout, zero_exact: bool, channel_dim: int | None
) -> None:
    """``d (s - d)`` is the exact variance ``t (1 - t) s²``: two seeds that round an element
    in opposite directions give the same value, and its mean over seeds is that of ``d²``.
    A wrong step (another group's, another channel's) breaks both. Channel groups of 2x3
    maps, memory-order groups, ReLU outputs on the sign-exact grid. The mean of ``d²`` over
    400 seeds is compared with a tolerance of 6 standard errors (false alarm < 1e-8)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 12, 4, 3, generator=gen) * torch.logspace(-2, 2, 12).view(1, -1, 1, 1)
    x = layout(x.relu() if zero_exact else x)

    def quantize(seed: int) -> gact_kernels.QuantizedTensor:
        return gact_kernels.quantize(
            x, 2, group_size=16, seed=seed, zero_exact=zero_exact, channel_dim=channel_dim
        )

    first = _variance(x, quantize(1))
    torch.testing.assert_close(_variance(x, quantize(2)), first, rtol=1e-5, atol=1e-12)
    squares = torch.stack(
        [(gact_kernels.dequantize(quantize(s)).double() - x.double()) ** 2 for s in range(400)]
    )
    mean, se = squares.mean(0).sum(), squares.sum((1, 2, 3, 4)).std() / 20
    assert abs(float(mean - first.sum())) <= 6 * float(se), (mean, first.sum())


def test_lossless_groups_have_step_zero() -> None:
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    q = gact_kernels.quantize(x, 4, group_size=64, seed=0)
    steps = gact_kernels.rounding_steps(q)
    assert (steps[1] == 0).all() and (steps[[0, 2, 3]] > 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_containers_give_float32_steps(dtype: torch.dtype) -> None:
    x = torch.randn(3, 256, dtype=dtype)
    q = gact_kernels.quantize(x, 3, group_size=128, seed=0)
    steps = gact_kernels.rounding_steps(q)
    assert steps.dtype == torch.float32
    torch.testing.assert_close(memory_flat(steps), step_per_element(q), rtol=1e-6, atol=0)


def test_rejects_other_containers() -> None:
    with pytest.raises(TypeError, match="QuantizedTensor"):
        gact_kernels.rounding_steps(gact_kernels.pack_mask(torch.ones(8, dtype=torch.bool)))
