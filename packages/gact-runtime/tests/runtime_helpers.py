"""Helpers shared by the runtime tests (imported as a module; conftest puts this folder on
``sys.path``)."""

from __future__ import annotations

import math
import types
from typing import Any, Callable

import gact_kernels
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gact import Controller, GactConfig
from gact.ledger import Kind
from gact.measured import SensitivityMeter
from torch import nn

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not gact_kernels.compiled_with_cuda(),
    reason="needs a CUDA device and the gact_kernels._cuda module",
)


#: the torch.compile backends the compiled tests run under
BACKENDS = ["aot_eager", "inductor"]


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)))
    den = math.sqrt(sum(float(y.pow(2).sum()) for y in b))
    return num / den


def make_closure(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, rng_seed: int = 123
) -> Callable[[], torch.Tensor]:
    """forward + cross-entropy + zero_grad + backward, with a fixed dropout stream."""

    def closure() -> torch.Tensor:
        torch.manual_seed(rng_seed)
        model.train()
        loss = F.cross_entropy(model(x), y)
        model.zero_grad()
        loss.backward()
        return loss

    return closure


def record_saves(controller: Any, monkeypatch: Any) -> list[object]:
    """A list that receives what ``controller``'s hooks return for every save of its model
    (``SavedKept`` / ``SavedCompressed``), in order."""
    saved: list[object] = []
    pack = controller.hooks.pack_own

    def recording(tensor: torch.Tensor, **kwargs: Any) -> object:
        saved.append(pack(tensor, **kwargs))
        return saved[-1]

    monkeypatch.setattr(controller.hooks, "pack_own", recording)
    return saved


class ManualEvent:
    """A CUDA event's ``query``/``synchronize`` for a CPU test: done once waited for."""

    def __init__(self) -> None:
        self.fired = False

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.fired = True


def deferred_quantize(real: Callable[..., Any], lossless: list[int] | None = None) -> Callable:
    """``quantize_async`` as on CUDA (NOTE [Deferred lossless check] in gact_kernels): the
    lossless groups are left to the synchronous path, which reads them from the input when the
    pending call is resolved (``ManualEvent``: only when the hooks force it). ``lossless``
    collects each call's number of lossless groups. Inputs grouped in memory order only."""

    def quantize_async(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        q = real(x, *args, **kwargs).result()
        # the block is x in memory order: groups in memory order, x dense (its own strides kept)
        assert q.channel_dim is None and q.stride == x.stride()
        if lossless is not None:
            lossless.append(len(q.lossless_groups))
        provisional = q._with(
            lossless_groups=torch.empty(0, dtype=torch.int64),
            lossless_values=x.new_empty((0, q.group_size)),
        )
        block = x.detach().as_strided((x.numel(),), (1,))
        return gact_kernels.PendingQuantize(provisional, block, ManualEvent())

    return quantize_async


def keep_exact(ctl: Controller, keep: Callable[[str], bool] = lambda key: True) -> None:
    """White box: the keys of the last completed step's quantized saves for which ``keep``
    holds are kept as they are from the next forward on."""
    records, _ = ctl.ledger.view()
    ctl.plan.kept_keys.update(
        key for key, rec in records.items() if rec.kind is Kind.QUANTIZED and keep(key)
    )


def cross_entropy_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: GactConfig | None
) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of ``cross_entropy(model(x), y)``, under a
    ``Controller(model, cfg)`` unless ``cfg`` is ``None`` (exact)."""
    model.zero_grad()
    if cfg is None:
        F.cross_entropy(model(x), y).backward()
    else:
        with Controller(model, cfg):
            F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def rounding_errors(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: GactConfig,
    names: tuple[str, ...],
    seeds: int = 32,
) -> tuple[float, float]:
    """The mean over rounding seeds 1..``seeds`` of the squared error, against the exact
    gradients, of the parameters ``names`` under ``cfg``, and its standard error."""
    exact = cross_entropy_grads(model, x, y, None)
    errors = []
    for seed in range(1, seeds + 1):
        g = cross_entropy_grads(model, x, y, cfg.replace(seed=seed))
        errors.append(sum(float((g[n] - exact[n]).square().sum()) for n in names))
    return float(np.mean(errors)), float(np.std(errors, ddof=1) / math.sqrt(seeds))


def measured_step(
    model: nn.Module, config: GactConfig, backward: Callable[[], Any]
) -> tuple[Controller, SensitivityMeter]:
    """One step of ``model`` under a ``Controller(model, config)`` whose hooks carry a running
    ``SensitivityMeter`` (NOTE [Measured sensitivities]): ``backward()`` runs the forward and
    backward; returns the controller and the stopped meter."""
    meter = SensitivityMeter()
    with Controller(model, config) as controller:
        controller.hooks.meter = meter
        meter.start()
        model.zero_grad()
        backward()
        meter.stop()
    return controller, meter


def fake_clocks(monkeypatch: pytest.MonkeyPatch, *, training: float, adapting: float) -> None:
    """Replace the clocks the time budget reads: the controller's advances ``training`` per
    reading, the adapter's and the meter's ``adapting`` (a machine on which training, or
    adapting, looks slow), so budget decisions do not depend on this machine's load."""
    clocks = {"controller": training, "adapt": adapting, "measured": adapting}
    for module, tick in clocks.items():
        now = iter(range(10**9))
        fake = types.SimpleNamespace(perf_counter=lambda now=now, tick=tick: tick * next(now))
        monkeypatch.setattr(f"gact.{module}.time", fake)
