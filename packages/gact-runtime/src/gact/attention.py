"""Fused attention whose backward is recomputed from the rounded saves (NOTE below)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.nn.attention import SDPBackend
from torch.utils.checkpoint import get_device_states, set_device_states

from . import compiled
from .decision_spec import DecisionSpec, argument

__all__ = [
    "ATTENTION_BITS", "ATTENTION_EXTRA_BITS", "RecomputedAttention", "recomputed", "recomputes",
    "rule",
]  # fmt: skip

# NOTE [Attention from its rounded inputs]
# ``F.scaled_dot_product_attention`` on its fused kernels saves ``q``, ``k``, ``v``, its output
# ``o`` and each query row's log-sum-exp ``m``, and its backward takes the attention weights as
# ``P = exp(q k^T * scale - m)`` and the softmax's correction per row as ``D = rowsum(dO * o)``.
# Both identities hold only for the exact tensors: with ``q``, ``k`` rounded and ``m`` kept, the
# rows of ``P`` no longer sum to 1 (``exp`` of an unbiased error is biased: at 2 bits, query and
# key gradients 1e10 times too large); with ``v`` and ``o`` rounded, ``D`` no longer matches ``P``
# and ``dO v^T``, so the rows of the scores' gradient ``dS`` no longer sum to 0, and the query
# gradient ``dS k`` picks up the keys' shared mean, which trained keys have and softmax ignores.
# On the model matrix's LLaMA-style decoder after 300 steps that made the query and key
# projections' rounding variance at L1 38-61% of their minibatch variance, with ``q`` and ``k``
# at 6 bits and ``m`` kept (BENCHMARKS.md, "Stability").
#
# So where GACT would compress its saves, a fused attention call runs as ``RecomputedAttention``:
# it saves ``q``, ``k`` and ``v`` only, and its backward runs the same call again on their rounded
# values and differentiates that. The gradient is then the exact gradient of attention at the
# rounded inputs (``P`` normalised, ``dS``'s rows summing to 0), as a linear layer's is the exact
# gradient at its rounded input; its error is first order in the rounding and unbiased there, like
# any nonlinear use's. On the same decoder (3 seeds, 300 steps) the projections' ratios fell to
# at most 9.4% and no longer lead (the MLP's down projection, a linear use, does: up to 18%), and
# L2.2's loss went from +81% to +25% above fp32's (its budget no longer pays a 6-bit floor on
# ``q`` and ``k``, 22% of the saved elements, which left the rest 1 bit). It stores less (no ``o``,
# no ``m``) and costs one attention forward more per backward, which is what checkpointing one
# attention call would cost. Both runs take the inputs' ``requires_grad``, grad mode and autocast
# state as the caller's call would, so PyTorch picks the same kernel twice (its choice depends on
# them); with dropout the backward replays the forward's random state (CPU and CUDA, as
# ``torch.utils.checkpoint`` does). Not recomputed, and saved as before with the floor and the kept
# log-sum-exp of NOTE [Attention and row normalisations] in decision_rules.py: calls under other
# saved-tensor hooks (a checkpointed region: its own recomputation covers them), at levels that
# compress nothing, calls on PyTorch's math path (no fused kernel: dropout on the CPU, among
# others; its ops save what they read, and recomputing it would redo its dropout mask and every
# product: BERT's CPU step took 1.69x fp32's instead of 1.11x), tensor subclasses, masks that
# need a gradient, dropout on other devices, and compiled graphs (decisions from the compiled
# backward: NOTE [Compiled saves] in compiled.py).
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _bind(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments by name, or ``None`` for a call this module does not know."""
    if len(args) > len(_NAMES) or not set(kwargs) <= set(_NAMES):
        return None
    bound = dict(zip(_NAMES, args))
    if set(bound) & set(kwargs):
        return None  # an argument given twice: let PyTorch raise its own error
    bound.update(kwargs)
    return bound


def _plain(value: Any) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter)


def recomputes(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a ``F.scaled_dot_product_attention`` call with these arguments, made now, runs as
    ``RecomputedAttention`` (NOTE [Attention from its rounded inputs])."""
    bound = _bind(args, kwargs)
    if bound is None or not torch.is_grad_enabled():
        return False
    q, k, v = (bound.get(name) for name in _NAMES[:3])
    mask = bound.get("attn_mask")
    if not all(_plain(t) for t in (q, k, v)) or not (mask is None or _plain(mask)):
        return False
    if not (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if mask is not None and mask.requires_grad:
        return False
    if bound.get("dropout_p", 0.0) and q.device.type not in ("cpu", "cuda"):
        return False
    if not _fused_kernel(bound):
        return False
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = top[0] if top is not None else None
    if not isinstance(pack, compiled.SaveHookModule):
        return False  # no GACT hooks, or others nearer (a checkpointed region)
    owner = pack.fn.__self__.owner()
    return owner is not None and owner.plan.config.spec.compresses


def _fused_kernel(bound: dict[str, Any]) -> bool:
    """Whether PyTorch runs the call on a fused kernel, not on its math path (the choice
    ``F.scaled_dot_product_attention`` makes, made the same way)."""
    try:
        choice = torch._fused_sdp_choice(**bound)
    except (RuntimeError, TypeError, ValueError):
        return False  # the call itself will say what is wrong with it
    return choice != int(SDPBackend.MATH)


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def _held_as_they_are() -> Iterator[None]:
    """Saves of the runs below are held uncompressed, for as long as their graph lives. A hook
    returning a saved output itself would tie it to its own node (output -> ``grad_fn`` ->
    saved output), a cycle through C++ that Python's collector never frees; its detached alias
    holds the same storage and version counter, no node."""
    with torch.autograd.graph.saved_tensors_hooks(_detached, _same):
        yield


class RecomputedAttention(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` saving ``q``, ``k``, ``v`` only; its backward runs the
    call again on their saved (rounded) values (NOTE [Attention from its rounded inputs])."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        options: dict[str, Any],
    ) -> torch.Tensor:
        ctx.options, ctx.attn_mask = options, attn_mask
        device = query.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.mask_version = None if attn_mask is None else attn_mask._version
        ctx.rng = None
        if options.get("dropout_p", 0.0):
            ctx.rng = (torch.get_rng_state(), *get_device_states(query, key, value))
        ctx.save_for_backward(query, key, value)
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (query, key, value)]
        with torch.enable_grad(), _held_as_they_are():
            out = F.scaled_dot_product_attention(*inputs, attn_mask=attn_mask, **options)
        return out.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors  # the rounded values
        mask = ctx.attn_mask
        if mask is not None and mask._version != ctx.mask_version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: the attn_mask of a scaled_dot_product_attention call is at "
                f"version {mask._version}; expected version {ctx.mask_version} instead."
            )
        inputs = [t.detach().requires_grad_(n) for t, n in zip(saved, ctx.needs_input_grad[:3])]
        wanted = [t for t in inputs if t.requires_grad]
        rng = contextlib.nullcontext()
        if ctx.rng is not None:
            cpu_state, devices, states = ctx.rng
            rng = torch.random.fork_rng(devices=devices)
        device, autocast, dtype = ctx.autocast  # the forward's, as checkpointing replays it
        with rng, torch.autocast(device, dtype, autocast), torch.enable_grad(), _held_as_they_are():
            if ctx.rng is not None:
                torch.set_rng_state(cpu_state)
                set_device_states(devices, states)
            out = F.scaled_dot_product_attention(*inputs, attn_mask=mask, **ctx.options)
            grads = iter(torch.autograd.grad(out, wanted, grad_out))
        return (*(next(grads) if t.requires_grad else None for t in inputs), None, None)


def recomputed(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Call ``F.scaled_dot_product_attention(*args, **kwargs)`` as ``RecomputedAttention``
    (for a call ``recomputes`` accepted)."""
    bound = _bind(args, kwargs)
    assert bound is not None
    query, key, value = (bound.pop(name) for name in _NAMES[:3])
    attn_mask = bound.pop("attn_mask", None)
    return RecomputedAttention.apply(query, key, value, attn_mask, bound)


ATTENTION_BITS = 6  # the smallest width of a fused attention's q and k (NOTE [Attention and row
# normalisations] in decision_rules.py)
ATTENTION_EXTRA_BITS = 2  # bits above the level's that a recomputed attention's q and k prefer


def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
    q, k = argument(args, kwargs, 0, "query", None), argument(args, kwargs, 1, "key", None)
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k)) or not q.numel():
        return None
    if recomputes(args, kwargs):  # NOTE [Attention from its rounded inputs]
        return DecisionSpec(
            extra_bits=ATTENTION_EXTRA_BITS, precise_ids=frozenset({id(q), id(k)}), recompute=True
        )
    rows = q.numel() // q.shape[-1]
    # the memory-efficient kernel pads each head's log-sum-exp to a multiple of 32 rows
    padded = rows // q.shape[-2] * (-(-q.shape[-2] // 32) * 32)
    return DecisionSpec(
        min_bits=ATTENTION_BITS, precise_ids=frozenset({id(q), id(k)}), exact_numel=padded
    )
