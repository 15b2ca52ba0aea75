"""Saves whose quantization has not reported its lossless groups yet (NOTE [Pending saves] in
hooks.py): at most ``MAX_PENDING`` wait, each is resolved before it is unpacked, and the
gradients and the ledger are those of saves resolved at once.

On a CUDA device the kernel reports through page-locked memory after an event; here, on the
CPU, ``ManualEvent`` stands in for that event so that the hooks' bookkeeping is exercised in
CI: it never fires by itself, so every resolution is one the hooks forced. The pending calls
are real ``PendingQuantize`` objects whose lossless groups are found by the synchronous path.
The CUDA path itself: test_cuda.py.
"""

from __future__ import annotations

import gact_kernels
import pytest
import torch
import torch.nn.functional as F
from gact import Controller, GactConfig
from gact.hooks import SaveHooks
from runtime_helpers import deferred_quantize, grads_of
from torch import nn

DEPTH = 12


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(DEPTH):  # LeakyReLU: decision masks taken while the save is pending
        layers += [nn.Linear(64, 64), nn.LeakyReLU(0.1) if i % 3 == 0 else nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def _run(deferred: bool, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> dict:
    model = _mlp()
    y = torch.arange(len(x)) % 10
    with monkeypatch.context() as m:
        if deferred:
            m.setattr(
                gact_kernels, "quantize_async", deferred_quantize(gact_kernels.quantize_async)
            )
        with Controller(model, GactConfig.from_level("L1", min_numel=0, seed=7)) as ctl:
            loss = F.cross_entropy(model(x), y)
            waiting = [s.payload._source is not None for s in ctl.hooks.pending if s.pending]
            loss.backward()
            left = [s for s in ctl.hooks.pending if s.pending]
            ctl.step()
            stats = ctl.stats()
    return {"grads": grads_of(model), "waiting": waiting, "left": left, "stats": stats}


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nan"])
def test_pending_saves_are_bounded_and_change_nothing(
    bad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(32, 64)
    if bad:
        x[3, 5] = float("nan")  # every later activation of row 3 is NaN: lossless groups
    now = _run(False, x, monkeypatch)
    later = _run(True, x, monkeypatch)
    assert now["waiting"] == [] and now["left"] == []  # the CPU reports at once
    assert len(later["waiting"]) == SaveHooks.MAX_PENDING  # of 2 saves per layer
    assert all(later["waiting"])  # each holds its input until resolved
    assert later["left"] == []  # the backward resolved the rest
    for a, b in zip(now["grads"], later["grads"]):  # bit for bit, NaNs included
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    if bad:
        assert any(torch.isnan(g).any() for g in later["grads"])
    assert later["stats"]["stored_bytes"] == now["stats"]["stored_bytes"]
    assert later["stats"]["compressed_tensors"] == now["stats"]["compressed_tensors"] > DEPTH


def test_a_resolved_save_releases_its_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        gact_kernels, "quantize_async", deferred_quantize(gact_kernels.quantize_async)
    )
    model = _mlp()
    with Controller(model, GactConfig.from_level("L1", min_numel=0)) as ctl:
        loss = model(torch.randn(32, 64)).sum()
        waiting = list(ctl.hooks.pending)
        assert len(waiting) == SaveHooks.MAX_PENDING
        assert all(s.pending and s.payload._source is not None for s in waiting)
        for saved in waiting:
            saved.payload._event.fired = True  # the device got there
        ctl.hooks.settle()  # what the next pack or unpack does
        assert not ctl.hooks.pending
        assert all(not s.pending and s.payload.lossless_groups.numel() == 0 for s in waiting)
        loss.backward()
