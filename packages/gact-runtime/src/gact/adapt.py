"""Adaptive precision: sensitivity probes and bit allocation through ``gact_policy``.

# NOTE [Probes leave no trace]
# A probe is one extra run of the user's closure with chosen bits and seeds. Around all probes
# of an adaptation, ``ProbeGuard`` keeps: the CPU and every initialised CUDA generator's state
# (reset before every probe, so dropout draws the same masks in each, and restored after), every
# buffer's value (BatchNorm running statistics and ``num_batches_tracked``), every module's
# training flag, and the gradient tensors the user's closure produced (set aside, so probes
# accumulate into fresh ``.grad`` tensors, and put back with their values). No optimizer is
# involved. Under torch.distributed, rank 0's list of items is used by every rank, so all ranks
# run the same number of probes (their all-reduces match) and allocate the same bits.
# The ledger of the open step is swapped out while probing, so ``stats()`` never counts probes.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import gact_policy
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .ledger import Kind, Ledger, SiteRecord
from .plan import BitPlan, ProbeOverride, mix_seed
from .saved import SaveHooks

__all__ = ["Adapter", "ProbeGuard"]

logger = logging.getLogger("gact")


class ProbeGuard:
    """Context manager that snapshots what probes could change and restores it on exit.

    Args:
        model: the model being probed.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    def __enter__(self) -> ProbeGuard:
        model = self._model
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        # The user's gradient tensors are set aside and later refilled in place: under DDP with
        # gradient_as_bucket_view=True they are views of the buckets that probes all-reduce into.
        self._grads = [
            (p, p.grad, None if p.grad is None else p.grad.detach().clone())
            for p in model.parameters()
        ]
        self._buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self._modes = [(m, m.training) for m in model.modules()]
        return self

    def reset_rng(self) -> None:
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)

    def clear_grads(self) -> None:
        for p, _, _ in self._grads:
            p.grad = None

    def __exit__(self, *exc: object) -> None:
        self.reset_rng()
        with torch.no_grad():
            for buf, value in self._buffers:
                buf.copy_(value)
            for p, grad, value in self._grads:
                if grad is not None:
                    grad.copy_(value)
                p.grad = grad
        for module, training in self._modes:
            module.training = training


class Adapter:
    """Estimates per-key sensitivities and allocates bits for the adaptive levels.

    Args:
        model: the model being trained.
        plan: the bit plan to update.
        hooks: the controller's hooks (their ledger is swapped out while probing).
    """

    def __init__(self, model: nn.Module, plan: BitPlan, hooks: SaveHooks) -> None:
        self._model = model
        self._plan = plan
        self._hooks = hooks
        self.count = 0
        self.seconds = 0.0

    def adapt(
        self,
        closure: Callable[[], Any],
        sites: dict[str, SiteRecord],
        run_closure: Callable[[Callable[[], Any]], Any],
    ) -> None:
        """Probe ``closure``, update the smoothed sensitivities and re-allocate bits.

        Args:
            closure: forward + backward on the probe batch.
            sites: the open step's records; every quantizable key among them is an item.
            run_closure: runs a closure and checks that it ran a backward.
        """
        items = _agreed([(r.key, r.numel, torch.finfo(r.dtype).bits) for r in sites.values()
                         if _quantizable(r)])  # fmt: skip
        if not items:
            return
        start = time.perf_counter()
        plan, cfg = self._plan, self._plan.config
        keys = [key for key, _, _ in items]
        index = {k: i for i, k in enumerate(keys)}
        numel = np.array([n for _, n, _ in items], dtype=np.int64)
        full_bits = np.array([b for _, _, b in items], dtype=np.int64)
        probe_bits = np.array(
            [min(plan.bits.get(k, plan.default_bits), 8) for k in keys], dtype=np.int64
        )
        fallback = mix_seed(cfg.seed, plan.step, 0xADA)
        ledger = self._hooks.ledger

        with ProbeGuard(self._model) as guard:

            def grad(probe: gact_policy.ProbeConfig) -> np.ndarray:
                plan.probe = ProbeOverride(index, probe.bits, probe.seeds, fallback)
                guard.reset_rng()
                guard.clear_grads()
                self._hooks.ledger = Ledger()
                run_closure(closure)
                return _flat_grad(self._model)

            try:
                estimate = self._estimate(grad, probe_bits)
            finally:
                plan.probe = None
                self._hooks.ledger = ledger

        # keys seen for the first time start from their own estimate
        previous = [plan.sensitivity.get(k, float(e)) for k, e in zip(keys, estimate)]
        sensitivity = gact_policy.smooth(previous, estimate, cfg.sensitivity_momentum)
        assert cfg.avg_bits is not None
        bits = gact_policy.allocate_bits(
            sensitivity,
            numel,
            cfg.avg_bits,
            full_bits=full_bits,
            overhead_bits=cfg.overhead_bits,
        )
        plan.bits = {k: int(b) for k, b in zip(keys, bits)}
        plan.sensitivity = {k: float(c) for k, c in zip(keys, sensitivity)}
        self.count += 1
        self.seconds += time.perf_counter() - start
        logger.info(
            "GACT adaptation %d at step %d: %d tensors, %.3fs, bits %s",
            self.count,
            plan.step,
            len(keys),
            time.perf_counter() - start,
            np.bincount(np.minimum(bits, 9), minlength=10)[1:].tolist(),
        )

    def _estimate(self, grad: Callable[[Any], np.ndarray], bits: np.ndarray) -> np.ndarray:
        cfg = self._plan.config
        seed = mix_seed(cfg.seed, self._plan.step, 0x5E5) >> 1
        if cfg.sensitivity_method == "probe":
            return gact_policy.probe_sensitivity(grad, bits, seed=seed)
        probes = max(cfg.num_probes or 0, gact_policy.min_pair_probes(bits.size))
        estimate = gact_policy.pairwise_sensitivity(grad, bits, num_probes=probes, seed=seed)
        # A pairwise estimate is an inner product of two noisy differences: for a tensor of
        # small but real sensitivity it can come out negative and be clipped to 0, which would
        # give that tensor 1 bit. Those items are measured again, one probe each.
        doubtful = np.flatnonzero(estimate <= 0)
        if doubtful.size:
            estimate[doubtful] = gact_policy.probe_sensitivity(
                _restricted(grad, bits, doubtful, seed), bits[doubtful], seed=seed + 1
            )
        return estimate


def _restricted(
    grad: Callable[[Any], np.ndarray], bits: np.ndarray, items: np.ndarray, seed: int
) -> Callable[[gact_policy.ProbeConfig], np.ndarray]:
    """``grad`` seen through a probe configuration of ``items`` only; the other items keep
    their bits and one fixed seed each."""
    fixed = np.array([mix_seed(seed, i) for i in range(bits.size)], dtype=np.uint64)

    def sub_grad(probe: gact_policy.ProbeConfig) -> np.ndarray:
        full_bits, full_seeds = bits.copy(), fixed.copy()
        full_bits[items] = probe.bits
        full_seeds[items] = probe.seeds
        return grad(gact_policy.ProbeConfig(full_bits, full_seeds))

    return sub_grad


def _agreed(items: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Rank 0's items on every rank of an initialised process group; ``items`` otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return items
    box = [items]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _quantizable(rec: SiteRecord) -> bool:
    """Quantized now, or kept at full precision by a previous allocation."""
    return rec.kind is Kind.QUANTIZED or (
        rec.kind is Kind.KEPT and rec.bits is not None and rec.bits > 8
    )


def _flat_grad(model: nn.Module) -> np.ndarray:
    """All parameters' gradients as one float64 vector (zeros where a probe left none)."""
    parts = [
        (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).to("cpu", torch.float64)
        for p in model.parameters()
    ]
    return torch.cat([g.reshape(-1) for g in parts]).numpy()
