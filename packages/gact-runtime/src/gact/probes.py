"""Sensitivity probes: extra runs of the user's closure that leave no trace, and what they
return (a fixed-size sketch of the gradient)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.utils._pytree
from torch import nn

from .ledger import Ledger
from .plan import BitPlan, ProbeOverride, mix_seed

if TYPE_CHECKING:
    from .hooks import SaveHooks
    from .measured import SensitivityMeter

__all__ = ["GradientSketch", "ProbeGuard", "ProbeSession", "trained_leaves"]

# NOTE [Probes leave no trace]
# A probe is one extra run of the user's closure with chosen bits and seeds. Around all probes of
# an adaptation, ``ProbeGuard`` keeps: the CPU and every initialised CUDA generator's state,
# NumPy's global one and Python's ``random`` (reset before every probe, so dropout and a forward's
# own draws, as SpecAugment's in transformers, are the same in each, and restored after), every
# buffer's value (BatchNorm running statistics and ``num_batches_tracked``), every module's
# training flag, and the gradient tensors the user's closure produced (set aside, so probes
# accumulate into fresh ``.grad`` tensors, and put back). A gradient that is a view into a larger
# storage (DDP's ``gradient_as_bucket_view=True``: probes all-reduce into the same buckets) is
# also copied and refilled in place; any other gradient tensor is set aside as it is, without a
# copy. No optimizer is involved. Under torch.distributed, rank 0's list of items is used by every
# rank, so all ranks run the same number of probes (their all-reduces match) and allocate the same
# bits. A closure may also train tensors outside the model (a head, a learnable loss): ``iterate``
# finds them as the leaves of the autograd graph of what the closure returned (its structure
# outlives the backward), and their gradients are set aside and restored as the model's; before,
# the last probe's gradient (another dropout mask: 1.05 off, relative norm) or the sum over every
# run replaced the real step's. Buffers of modules outside the model cannot be found so:
# ``iterate`` warns that probes update them.


def trained_leaves(result: Any) -> list[torch.Tensor]:
    """The leaf tensors the tensors in ``result`` were computed from that require grad (the
    ``AccumulateGrad`` nodes of their autograd graphs)."""
    stack = [
        t.grad_fn
        for t in torch.utils._pytree.tree_leaves(result)
        if isinstance(t, torch.Tensor) and t.grad_fn is not None
    ]
    seen, leaves = set(), []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _copy_if_shared(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of ``grad`` if it is a view into a larger storage (a DDP bucket view)."""
    if grad is None:
        return None
    grad = _local(grad)
    shared = grad._base is not None or grad.untyped_storage().nbytes() > grad.nbytes
    return grad.detach().clone() if shared else None


class ProbeGuard:
    """Context manager that snapshots what probes could change and restores it on exit.

    Args:
        model: the model being probed.
        leaves: tensors outside the model whose gradients the probes' closure writes too.
    """

    def __init__(self, model: nn.Module, leaves: Sequence[torch.Tensor] = ()) -> None:
        self._model = model
        self._leaves = leaves

    def __enter__(self) -> ProbeGuard:
        model = self._model
        self._cpu_rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        # the global streams a forward may draw from
        self._numpy_rng = np.random.get_state()  # noqa: NPY002
        self._python_rng = random.getstate()
        trained = (*model.parameters(), *self._leaves)
        self._grads = [(p, p.grad, _copy_if_shared(p.grad)) for p in trained]
        self._buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self._modes = [(m, m.training) for m in model.modules()]
        return self

    def reset_rng(self) -> None:
        torch.set_rng_state(self._cpu_rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state_all(self._cuda_rng)
        np.random.set_state(self._numpy_rng)  # noqa: NPY002
        random.setstate(self._python_rng)

    def clear_grads(self) -> None:
        for p, _, _ in self._grads:
            p.grad = None

    def __exit__(self, *exc: object) -> None:
        self.reset_rng()
        with torch.no_grad():
            for buf, value in self._buffers:
                buf.copy_(value)
            for p, grad, value in self._grads:
                if value is not None:
                    _local(grad).copy_(value)
                p.grad = grad
        for module, training in self._modes:
            module.training = training


# NOTE [Gradient sketch]
# The estimators in gact_policy compare probe gradients only through inner products and norms.
# Copying every probe's gradient to the host would cost O(parameters x probes) memory (1.7 GB of
# float64 for one adaptation of an 11M-parameter ResNet-18), so each probe's gradient is reduced
# on its device to a vector of at most ``width`` entries: the gradient itself when the model has
# no more parameters than that (exact), otherwise a CountSketch: coordinate i goes to bucket
# h(i) with sign s(i), drawn once per adaptation from seeded generators and redrawn identically
# for every probe (one random 31-bit word per coordinate: bit 30 is the sign, the rest modulo
# ``width`` the bucket; with two bounded draws per coordinate, sketching a ResNet-18's 11M
# parameters took 1.1-2.2 times its forward and backward at batch 64 on one or two CPU
# threads, with one draw 0.76-1.06 times). The map is linear and ``E[<S a, S b>] = <a, b>``,
# with variance at most ``2 |a|^2 |b|^2 / width``; at the default width of 2^18 that is a few
# percent of the pairwise estimator's own noise. Memory: ``width`` floats per probe on the
# host, and one chunk of bucket indices at a time on the device.
_CHUNK = 1 << 22


class GradientSketch:
    """A fixed linear map from all parameters' gradients to at most ``width`` floats.

    Args:
        model: the model whose ``.grad`` tensors are read (missing gradients count as zeros).
        width: the largest output size; models with at most this many parameters are exact.
        seed: the seed of the bucket and sign draws.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> model(torch.ones(1, 4)).sum().backward()
        >>> GradientSketch(model, width=1024, seed=0)().shape  # 10 parameters: exact
        (10,)
    """

    def __init__(self, model: nn.Module, *, width: int = 1 << 18, seed: int = 0) -> None:
        self._params = list(model.parameters())
        total = sum(p.numel() for p in self._params)
        # Sharded parameters (FSDP2, DTensor): every rank sketches its own shards with its own
        # draws and the sketches are summed over the process group.
        self._sharded = any(hasattr(p, "to_local") for p in self._params)
        self.exact = total <= width and not self._sharded
        self.width = total if self.exact else width
        self._pow2 = self.width & (self.width - 1) == 0
        self._seed = mix_seed(seed, dist.get_rank()) if self._sharded else seed

    def __call__(self) -> np.ndarray:
        """The sketch of the current gradients, as float64."""
        if self.exact:
            parts = [
                torch.zeros(p.numel()) if p.grad is None else p.grad.detach().reshape(-1).cpu()
                for p in self._params
            ]
            return torch.cat(parts).double().numpy() if parts else np.zeros(0)
        out: dict[torch.device, torch.Tensor] = {}
        for i, p in enumerate(self._params):
            if p.grad is None:
                continue
            flat = _local(p.grad).detach().reshape(-1)
            acc = out.setdefault(flat.device, torch.zeros(self.width, device=flat.device))
            for c in range(math.ceil(flat.numel() / _CHUNK)):
                part = flat[c * _CHUNK : (c + 1) * _CHUNK].float()
                gen = torch.Generator(device=part.device).manual_seed(mix_seed(self._seed, i, c))
                # one random word per coordinate (31 bits): bit 30 its sign, the rest its bucket
                word = torch.empty(part.shape, dtype=torch.int32, device=part.device)
                word.random_(generator=gen)
                sign = (word >> 30).float().mul_(2.0).sub_(1.0)
                word &= (1 << 30) - 1
                bucket = word & (self.width - 1) if self._pow2 else word.remainder_(self.width)
                acc.index_add_(0, bucket, part * sign)  # (part may be the gradient itself)
        total = torch.zeros(self.width, dtype=torch.float64)
        for acc in out.values():
            if self._sharded:
                dist.all_reduce(acc)
            total += acc.cpu().double()
        return total.numpy()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor; any other tensor as it is."""
    local = getattr(tensor, "to_local", None)
    return tensor if local is None else local()


class ProbeSession:
    """Runs ``closure`` with chosen bits and seeds per item, leaving no trace.

    Inside ``with ProbeSession(...) as session:``, ``session.grad(bits, seeds)`` runs one probe
    (forward and backward on the closure's batch) with item ``i`` (``keys[i]``) stored at
    ``bits[i]`` bits (``>= 16``: kept at full precision) with seed ``seeds[i]``, and returns
    the gradient's sketch. The open step's ledger is swapped out meanwhile, so ``stats()``
    never counts probes.

    Args:
        model: the model being trained.
        plan: the controller's bit plan (its probe override is set per probe).
        hooks: the controller's hooks.
        closure: forward, loss and backward on the probe batch.
        run_closure: runs a closure and checks that it ran a backward.
        keys: the items' save-site keys.
        seed: seeds the sketch and the seeds of keys that are not items.
        sketch_width: see ``GradientSketch``.
        meter: measures linearly read keys during every probe (NOTE [Measured sensitivities]
            in measured.py), or ``None``; may be set between probes.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: BitPlan,
        hooks: SaveHooks,
        closure: Callable[[], Any],
        run_closure: Callable[[Callable[[], Any]], Any],
        keys: list[str],
        *,
        seed: int,
        sketch_width: int = 1 << 18,
        meter: SensitivityMeter | None = None,
    ) -> None:
        self._model, self._plan, self._hooks = model, plan, hooks
        self.meter = meter
        self._closure, self._run_closure = closure, run_closure
        self._index = {k: i for i, k in enumerate(keys)}
        self._fallback = mix_seed(seed, 0xADA)
        self.sketch = GradientSketch(model, width=sketch_width, seed=mix_seed(seed, 0x5CE))
        self.runs = 0

    def __enter__(self) -> ProbeSession:
        self._guard = ProbeGuard(self._model, self._hooks.closure_leaves).__enter__()
        self._ledger = self._hooks.ledger
        self._hooks.probing = True
        return self

    def grad(self, bits: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """One probe: the sketch of the gradient with these bits and seeds per item."""
        self.run(bits, seeds)
        return self.sketch()

    def run(self, bits: np.ndarray, seeds: np.ndarray) -> None:
        """One probe whose gradient is not read (its meter's measurements are)."""
        self._plan.probe = ProbeOverride(self._index, bits, seeds, self._fallback)
        self._guard.reset_rng()
        self._guard.clear_grads()
        self._hooks.ledger = Ledger()
        self.runs += 1
        meter, outer = self.meter, self._hooks.meter  # the step's own, if it measures
        if meter is not None:
            self._hooks.meter = meter
            meter.start()
        try:
            self._run_closure(self._closure)
        finally:
            self._plan.probe = None
            if meter is not None:
                meter.stop()
                self._hooks.meter = outer

    def __exit__(self, *exc: object) -> None:
        self._hooks.ledger = self._ledger
        self._hooks.probing = False
        self._guard.__exit__(*exc)
