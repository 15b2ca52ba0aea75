"""quantize_async and PendingQuantize: the same bytes as quantize, without a synchronisation on
CUDA (NOTE [Deferred lossless check] in pending.py). The CUDA tests run in the device checks."""

from __future__ import annotations

import gact_kernels
import pytest
import torch
from gact_kernels import _backend, pending
from kernels_testing import DTYPES, requires_cuda


def _with_bad_groups(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """5 groups of 256; groups 1 and 3 hold a NaN and an Inf."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5 * 256 - 7, generator=gen).to(dtype)
    x[300], x[900] = float("nan"), float("-inf")
    return x.to(device)


def _same(a: gact_kernels.QuantizedTensor, b: gact_kernels.QuantizedTensor) -> bool:
    """Equal containers, buffers compared bit for bit on the CPU."""
    return a.to("cpu") == b.to("cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_is_resolved_at_once(dtype: torch.dtype) -> None:
    x = _with_bad_groups(dtype)
    p = gact_kernels.quantize_async(x, 3, seed=5)
    assert p.done() and p.result() is p.result()
    q = p.result()
    assert q == gact_kernels.quantize(x, 3, seed=5)
    assert q.lossless_groups.tolist() == [1, 3]
    assert "resolved" in repr(p)


def test_containers_without_lossless_groups_share_empty_buffers() -> None:
    a = gact_kernels.quantize(torch.randn(600), 4, seed=1)
    b = gact_kernels.quantize(torch.randn(700), 2, seed=2)
    assert a.lossless_groups is b.lossless_groups and a.lossless_groups.numel() == 0
    assert a.lossless_values.shape == (0, 256) and a.lossless_values.dtype == torch.float32
    # they are still validated as any other container (NOTE [container invariants])
    a._validate()


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("channel_dim", [None, 1])
def test_cuda_result_equals_the_cpu_bytes(
    dtype: torch.dtype, bad: bool, channel_dim: int | None
) -> None:
    x = _with_bad_groups(dtype) if bad else torch.randn(5 * 256 - 7).to(dtype)
    x = x[: 12 * 100].view(12, 10, 10) if channel_dim is not None else x
    cpu = gact_kernels.quantize(x, 5, seed=9, channel_dim=channel_dim)
    p = gact_kernels.quantize_async(x.cuda(), 5, seed=9, channel_dim=channel_dim)
    assert _same(p.result(), cpu)
    assert bool(cpu.lossless_groups.numel()) == bad


@requires_cuda
def test_cuda_enqueues_without_synchronising() -> None:
    """Under torch's sync debug mode a synchronising op raises: ``quantize`` used to call
    ``nonzero`` after every kernel."""
    x = torch.randn(64, 1000, device="cuda")
    gact_kernels.quantize_async(x, 4).result()  # creates the flag ring outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pendings = [gact_kernels.quantize_async(x, 4, seed=s) for s in range(8)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for s, p in enumerate(pendings):
        assert _same(p.result(), gact_kernels.quantize(x.cpu(), 4, seed=s))


@requires_cuda
def test_cuda_flag_reports_lossless_groups() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    ring = pending.flag_ring()
    assert ring.usable
    clean = gact_kernels.quantize_async(torch.randn(4096, device=device), 4)
    bad = gact_kernels.quantize_async(_with_bad_groups(torch.float32, "cuda"), 4)
    torch.cuda.synchronize()
    assert ring.view[clean._slot] == 0 and ring.view[bad._slot] == 1
    assert clean.done() and bad.done()
    assert clean.result().lossless_groups.numel() == 0
    assert bad.result().lossless_groups.tolist() == [1, 3]


@requires_cuda
def test_cuda_reused_slot_is_not_trusted() -> None:
    """A pending call whose flag slot was taken by later calls (which zero it) must not read
    the byte: it takes the synchronous path and still finds its lossless groups."""
    x = _with_bad_groups(torch.float32, "cuda")
    first = gact_kernels.quantize_async(x, 4, seed=3)
    torch.cuda.synchronize()  # its kernel has set the byte: the reuse below clears it
    small = torch.randn(256, device="cuda")
    later = [gact_kernels.quantize_async(small, 4) for _ in range(pending._SLOTS)]
    torch.cuda.synchronize()
    ring = pending.flag_ring()
    assert ring.owners[first._slot] != first._ticket and ring.view[first._slot] == 0
    assert _same(first.result(), gact_kernels.quantize(x.cpu(), 4, seed=3))
    assert first.result().lossless_groups.tolist() == [1, 3]
    assert all(p.result().lossless_groups.numel() == 0 for p in later[-4:])


@requires_cuda
def test_cuda_flags_live_in_memory_the_device_addresses() -> None:
    addressable = _backend._cuda.device_addressable
    assert addressable(torch.zeros(8, dtype=torch.uint8, pin_memory=True).data_ptr())
    assert not addressable(torch.zeros(8, dtype=torch.uint8).data_ptr())  # pageable
    assert not addressable(torch.zeros(8, dtype=torch.uint8, device="cuda").data_ptr())
