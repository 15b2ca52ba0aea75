"""Who made a save: torch's checkpointing, a custom ``torch.autograd.Function``, or the model's
own ops (NOTE [Checkpointed regions], NOTE [Custom functions])."""

from __future__ import annotations

import os
import sys

import torch

from .attention import RecomputedAttention

__all__ = [
    "CHECKPOINT", "COMPRESSED_FUNCTIONS", "FUNCTION", "made_by", "recomputing_checkpoint",
]  # fmt: skip

# NOTE [Checkpointed regions]
# Non-reentrant ``torch.utils.checkpoint`` is itself a pair of saved-tensor hooks: inside a
# region its hooks are the innermost, so GACT never sees what the region saves, neither in the
# forward nor when the backward recomputes it (those tensors are held exact, and only while the
# region's backward runs). What the checkpoint keeps, the region's inputs, it saves through the
# hooks outside the region: GACT's. Compressing them would make the recomputation run on the
# dequantized input, and the region's gradient that of a perturbed input: the exact-decision
# guarantee (NOTE [Exact decisions] in decisions.py) is lost, because the recomputed ReLUs
# decide on the rounded values. On three checkpointed Linear-ReLU-Linear blocks at 4 bits the
# mean gradient over 200 seeds was 26% off the fp32 one (GACT without checkpointing: within
# noise), and the inputs are a small part of the peak (BENCHMARKS.md, "GACT against
# checkpointing"). So they are kept as they are unless ``compress_checkpoint_inputs`` is set.
# (Reentrant checkpointing recomputes through the hooks of the thread: GACT compresses those
# recomputed saves, which live only while the region's backward runs.)
# They are recognised by the Python code that made the save: a function of torch's
# checkpoint.py (the non-reentrant ``save_inputs``; the reentrant ``checkpoint``, through
# ``Function.apply``, whose ``CheckpointFunction`` saves them with ``save_for_backward``).
_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")
_FUNCTION_FILE = os.path.join("torch", "autograd", "function.py")

# NOTE [Custom functions]
# A ``torch.autograd.Function``'s backward is Python code GACT cannot read: ``DecisionMode``
# sees the ops of its forward, which run without autograd and save nothing, but not what the
# backward does with ``ctx.save_for_backward``'s tensors. One that decides on a save (a
# hand-written ReLU's ``g * (x > 0)``, a fused activation's) decided on the rounded values,
# and its gradient was biased: a custom ReLU's first-layer weight gradient 24% of its norm off
# at 4 bits, however many seeds were averaged (``torch.relu``'s, whose rule GACT knows: within
# noise). So what a custom Function saves is kept as it is, unless
# ``compress_custom_functions``; it is recognised, like a reentrant checkpoint's save, by
# ``Function.apply`` being the Python frame that packs it. GACT's own Function
# (``RecomputedAttention``, built to be compressed) is compressed as usual, and so are the
# library Functions in ``COMPRESSED_FUNCTIONS``, whose backwards read their saves linearly or
# through a smooth function (as GACT's rules find for the built-in ops): BLOOM's GELU, whose
# input is the largest save of its MLP. Matched by module and qualified name, so that the
# library need not be installed.
CHECKPOINT, FUNCTION = "checkpoint", "function"  # who made a save (``made_by``)
COMPRESSED_FUNCTIONS: frozenset[tuple[str, str]] = frozenset(
    {("transformers.models.bloom.modeling_bloom", "GeLUFunction")}
)


def made_by() -> str | None:
    """Who made the save being packed: ``CHECKPOINT`` (torch's checkpoint.py, directly or
    through ``Function.apply``: NOTE [Checkpointed regions]), ``FUNCTION`` (another
    ``torch.autograd.Function`` than GACT's own: NOTE [Custom functions]), else ``None``."""
    try:
        frame = sys._getframe(2)  # made_by <- pack <- the code that saved
    except ValueError:  # no Python code made it (a save on a thread of PyTorch's own)
        return None
    code = frame.f_code
    if code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_FILE):
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return CHECKPOINT
        cls = frame.f_locals.get("cls")
        if cls is RecomputedAttention or (
            (getattr(cls, "__module__", None), getattr(cls, "__qualname__", None))
            in COMPRESSED_FUNCTIONS
        ):
            return None
        return FUNCTION
    return CHECKPOINT if code.co_filename.endswith(_CHECKPOINT_FILE) else None


def recomputing_checkpoint() -> bool:
    """Whether a backward on this thread is recomputing a reentrant checkpoint region (NOTE
    [Checkpointed regions]): the saves it makes live only while the region's backward runs."""
    if torch._C._current_graph_task_id() == -1:  # no backward runs on this thread
        return False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "backward" and code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False
