"""The runtime on a CUDA device: every level (L3's swap moves bytes and nothing else), the
allocator's peak, autocast with a gradient scaler, and compiled graphs (unbiased gradients on
CUDA: test_gradients.py, parametrized by device).

These run only where torch sees a GPU and gact-kernels was built with its CUDA module; CI has
none, so they run in the device checks (``.ci/gpu-check``), whose results BENCHMARKS.md records.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from gact import Controller, GactConfig, GactWarning
from gact.hooks import SaveHooks
from runtime_helpers import grads_of, relative_error, requires_cuda
from torch import nn

pytestmark = requires_cuda

CUDA = torch.device("cuda")


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.GELU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    ).to(CUDA)  # fmt: skip


def _batch(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(n, 3, 16, 16, device=CUDA, generator=gen)
    return x, torch.randint(0, 10, (n,), device=CUDA, generator=gen)


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("level", ["L0", "L1", "L1.1", "L2", "L3"])
def test_every_level_trains_on_cuda(level: str) -> None:
    model = _conv_net()
    x, y = _batch()
    _step(model, x, y)
    reference = grads_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with Controller(model, GactConfig.from_level(level, min_numel=0, adapt_interval=2)) as ctl:
        for _ in range(6):
            losses.append(float(ctl.iterate(lambda: _step(model, x, y))))
            optimizer.step()
        stats = ctl.stats()
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    if level == "L0":
        assert stats["compressed_tensors"] == 0
        return
    assert stats["compressed_tensors"] >= 4 and stats["ratio"] > 2
    if level == "L1.1":  # 8 bits: the first step's gradient is close to fp32's
        model2 = _conv_net()
        with Controller(model2, GactConfig.from_level(level, min_numel=0)) as ctl2:
            ctl2.iterate(lambda: _step(model2, x, y))
        assert relative_error(grads_of(model2), reference) < 0.05


@torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True)
def test_swap_moves_bytes_and_nothing_else() -> None:
    """L3 = L2 + payloads waiting in pinned host memory: with the same seed the gradients are
    bit-identical to L2's (cuDNN's deterministic algorithms: its default ones sum a convolution's
    weight gradient in a varying order), and the device holds less between forward and
    backward."""
    x, y = _batch(64)
    grads, held = {}, {}
    for level in ("L2", "L3"):
        model = _conv_net()
        config = GactConfig.from_level(level, min_numel=0, seed=3, adapt_interval=10**6)
        with Controller(model, config) as ctl:
            ctl.iterate(functools.partial(_step, model, x, y))  # step 0 at the default bits
            model.zero_grad()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss = F.cross_entropy(model(x), y)
            torch.cuda.synchronize()
            torch.empty(1, device=CUDA)  # the allocator frees blocks whose side-stream use ended
            held[level] = torch.cuda.memory_allocated() - before
            loss.backward()
            ctl.step()
        grads[level] = grads_of(model)
    for a, b in zip(grads["L2"], grads["L3"]):
        assert torch.equal(a, b)
    assert held["L3"] < 0.7 * held["L2"], held


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).to(CUDA)


def _activation_peak(level: str | None) -> int:
    """The CUDA allocator's peak over one training step, above what was allocated before it."""
    model = _mlp(1024, 8)
    x = torch.randn(4096, 1024, device=CUDA)
    y = torch.randint(0, 10, (4096,), device=CUDA)
    _step(model, x, y)  # gradients allocated: the peak below is the step's own
    controller = None if level is None else Controller(model, GactConfig.from_level(level))
    if controller is not None:
        controller.install_hook()
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(model, x, y)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    finally:
        if controller is not None:
            controller.uninstall_hook()


def test_allocator_peak_falls_with_compressed_saves() -> None:
    """8 GELU blocks of 4096 x 1024: fp32 saves 2 x 16 MiB per block; L1 stores 4 bits."""
    fp32, l1 = _activation_peak(None), _activation_peak("L1")
    assert l1 < 0.45 * fp32, (fp32, l1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_with_gradient_scaler(dtype: torch.dtype) -> None:
    x, y = _batch(64)
    runs = {}
    for level in (None, "L1.1", "L2"):
        model = _conv_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        ctl = None if level is None else Controller(model, GactConfig.from_level(level, seed=0))
        if ctl is not None:
            ctl.install_hook()
        try:
            losses = []
            for _ in range(8):
                with torch.autocast("cuda", dtype=dtype):
                    loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                if not losses:
                    first = grads_of(model)
                scaler.step(optimizer)
                scaler.update()
                losses.append(float(loss))
                if ctl is not None:
                    ctl.step()
            if ctl is not None:
                records = ctl.ledger.last
                assert any(
                    r.dtype == dtype and r.kind.value == "quantized" for r in records.values()
                )
        finally:
            if ctl is not None:
                ctl.uninstall_hook()
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
        runs[level] = first
    assert relative_error(runs["L1.1"], runs[None]) < 0.05
    assert relative_error(runs["L2"], runs[None]) < 0.5


def test_compiled_model_on_cuda() -> None:
    """An inductor-compiled CNN on the GPU trains with compressed saves inside its graphs (the
    compiled module given to the controller: torch 2.11 traces the hooks too, NOTE [Compiled
    forwards] in scope.py)."""
    x, y = _batch(32)
    start = [p.detach().clone() for p in _conv_net().parameters()]
    weights = {}
    for level in (None, "L1"):
        torch._dynamo.reset()
        model = _conv_net()
        compiled_model = torch.compile(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        ctl = None if level is None else Controller(compiled_model, GactConfig.from_level(level))
        if ctl is not None:
            ctl.install_hook()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", GactWarning)
                for _ in range(3):
                    _step(compiled_model, x, y)
                    optimizer.step()
                    if ctl is not None:
                        ctl.step()
            if ctl is not None:
                assert ctl.hooks.compiled_sites
                assert ctl.stats()["ratio"] > 1.2  # inductor keeps the stem conv (issue 21)
                assert any("@" in key for key in ctl.ledger.last)
                assert not [w for w in caught if w.category is GactWarning]
        finally:
            if ctl is not None:
                ctl.uninstall_hook()
        weights[level] = [p.detach() for p in model.parameters()]
    moved = [w - s for w, s in zip(weights[None], start)]
    error = relative_error([w - s for w, s in zip(weights["L1"], start)], moved)
    assert error < 0.2


def _pending_step(
    bad: bool, max_pending: int, check_syncs: bool, monkeypatch: pytest.MonkeyPatch
) -> dict:
    """One L1 step of a ReLU/Tanh MLP (quantized saves and exact decision masks, no integer
    saves); with ``check_syncs`` its forward runs under torch's sync debug mode, where a
    synchronising op raises."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[m for _ in range(6) for m in (nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
                                        nn.Tanh())],
        nn.Linear(512, 10),
    ).to(CUDA)  # fmt: skip
    x = torch.randn(256, 512, device=CUDA)
    if bad:
        x[7, 3] = float("nan")  # row 7 turns NaN everywhere: lossless groups in every save
    y = torch.randint(0, 10, (256,), device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    monkeypatch.setattr(SaveHooks, "MAX_PENDING", max_pending)
    with Controller(model, GactConfig.from_level("L1", seed=4)) as ctl:
        model(x)  # the flag ring and the caches are made outside the check
        torch.cuda.synchronize()
        if check_syncs:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        waiting = sum(s.pending for s in ctl.hooks.pending)
        F.cross_entropy(out, y).backward()
        ctl.step()
        stats = ctl.stats()
    return {"grads": grads_of(model), "waiting": waiting, "stats": stats}


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nan"])
def test_pending_saves_on_cuda(bad: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [Pending saves]: a forward whose saves never wait for their kernels makes no
    synchronisation (each quantize used to make one, to find lossless groups; a NaN group
    still needs one, when resolved); the default bound keeps at most ``MAX_PENDING`` waiting;
    every save waiting for its kernel at once gives bit-identical gradients and ledger."""
    default = SaveHooks.MAX_PENDING
    never = _pending_step(bad, 10**6, not bad, monkeypatch)
    bounded = _pending_step(bad, default, False, monkeypatch)
    waited = _pending_step(bad, 0, False, monkeypatch)
    assert bounded["waiting"] <= default and waited["waiting"] == 0
    for run in (never, bounded):
        for a, b in zip(run["grads"], waited["grads"]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert run["stats"]["stored_bytes"] == waited["stats"]["stored_bytes"]
    assert waited["stats"]["compressed_tensors"] >= 12
