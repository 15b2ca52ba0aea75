"""How a compiled graph reads a saved node: families of aten ops and predicates on the nodes of
the forward and backward graphs (torch.fx) that ``CompiledSite.of`` in compiled_sites.py decides
with (NOTE [Decisions from the backward graph] there)."""

from __future__ import annotations

import math
import operator
import re
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .errors import GactError

__all__ = [
    "ATTENTION", "MATMULS", "RECIPROCALS", "RELU", "RELU_OF", "SAME", "SHAPE_READERS",
    "TIES_OR_DIVISIONS", "TIES_OR_PRODUCTS", "TOLERANT", "VARIANCES", "VIEWS", "alias_base",
    "at_least_a_constant", "comparisons", "constant_at", "decision_mask", "find_placeholder",
    "is_returned", "less", "less_a_saved_tensor", "log_softmax_output", "module_path",
    "normalises", "numel_of", "op_name", "statistic", "through_exp", "uses_of",
]  # fmt: skip


# Ops whose result always shares its argument's storage (``alias_base`` follows only these).
_ALIASES = {
    "aten.detach", "aten.alias", "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose",
    "aten.permute", "aten.expand", "aten.squeeze", "aten.unsqueeze", "aten.slice", "aten.select",
    "aten.as_strided", "aten.unflatten", "aten.split", "aten.split_with_sizes", "aten.unbind",
}  # fmt: skip
# Uses that pass their first argument on unchanged: aliases and copies (a pack may be placed
# after them, their argument being their one base).
VIEWS = _ALIASES | {
    "aten.reshape", "aten.flatten", "aten.clone", "aten.contiguous", "aten._to_copy",
    "prims.convert_element_type", "aten.flip", "aten.roll",
}  # fmt: skip
# Uses that pass the tensor on unchanged, followed to their own users: views, and the joins of
# several tensors (no view of one base: a pack is never placed after them).
_PASSED_ON = VIEWS | {"aten.cat", "aten.stack"}
# Affine steps between a saved tensor and the ``exp`` of a recomputed softmax.
_AFFINE = {"aten.sub", "aten.add", "aten.mul", "aten.neg", "aten.div"}
# Uses that read only the saved tensor's shape (their indices or target decide).
SHAPE_READERS = {
    "aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.sym_size",
    "aten.sym_stride", "aten.sym_numel",
    "aten.max_pool2d_with_indices_backward", "aten.max_pool3d_with_indices_backward",
    "aten.avg_pool2d_backward", "aten.avg_pool3d_backward", "aten._adaptive_avg_pool2d_backward",
    "aten.nll_loss_backward", "aten.nll_loss2d_backward",
}  # fmt: skip
# Uses whose result is linear in the tensor or a smooth function of it, or reads its shape:
# compressed, as eager code compresses the saves of these functions' inputs and outputs.
TOLERANT = SHAPE_READERS | {
    "aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.matmul", "aten.convolution_backward",
    "aten.convolution", "aten.mul", "aten.add", "aten.sub", "aten.rsub", "aten.neg", "aten.sum",
    "aten.mean", "aten.where", "aten.exp", "aten.erf", "aten.tanh", "aten.sigmoid",
    "aten.gelu", "aten.silu", "aten.gelu_backward", "aten.silu_backward",
    "aten.sigmoid_backward", "aten.tanh_backward", "aten.softplus", "aten.softplus_backward",
    "aten._softmax_backward_data",
    "aten.native_batch_norm_backward", "aten.addcmul", "prims.fma",
    # grouped matrix products of mixtures of experts (transformers' fallback is an opaque op)
    "aten._grouped_mm", "transformers.grouped_mm_fallback_backward",
}  # fmt: skip
# Comparisons with a constant, and whether the predicate recording them is strict: ``x > t``
# records ``gt`` and ``le`` alike (one is the other's negation), ``x >= t`` ``ge`` and ``lt``.
_COMPARISONS = {"aten.gt": True, "aten.le": True, "aten.ge": False, "aten.lt": False}
# Uses that read the sign: ``x > 0`` and ``x >= 0`` recorded exactly tell it.
_SIGNS = {"aten.abs", "aten.sgn", "aten.sign"}
# Fused attention backwards: (argument positions of q and k, position of the log-sum-exp).
ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": ((1, 2), 5),
    "aten._scaled_dot_product_flash_attention_backward": ((1, 2), 5),
    "aten._scaled_dot_product_efficient_attention_backward": ((1, 2), 6),
    "aten._scaled_dot_product_cudnn_attention_backward": ((1, 2), 5),
    "aten._efficient_attention_backward": ((1, 2), 7),
    "aten._flash_attention_backward": ((1, 2), 5),
}
RECIPROCALS = {"aten.rsqrt", "aten.reciprocal"}
# Outputs whose backward divides by the inputs or shares the gradient among ties (NOTE [Exact
# decisions] in decisions.py): kept, as eager code keeps the saves of these calls.
TIES_OR_PRODUCTS = {
    "aten.prod", "aten.cumprod", "aten.scatter_reduce", "aten.index_reduce",
    "aten.segment_reduce",
}  # fmt: skip
# Backward uses that find ties (``eq``: a maximum's gradient shared among the values equal to
# it), multiply the other inputs of a product together (dividing by one where none is 0) or
# divide by distances: kept, as eager code keeps these calls' saves.
TIES_OR_DIVISIONS = {
    "aten.eq", "aten.ne", "aten.prod", "aten.cumprod", "aten.scatter_reduce",
    "aten._cdist_backward", "aten._pdist_backward", "aten._segment_reduce_backward",
}  # fmt: skip
# Statistics a backward recomputes (inductor's BatchNorm on small maps): a variance computed
# from rounded values is biased upwards by the rounding's own variance.
VARIANCES = {"aten.var_mean", "aten.var", "aten.std", "aten.std_mean"}
MATMULS = {"aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.convolution_backward"}
# Reductions, and the outputs of fused ops that are statistics (per row or channel).
_REDUCTIONS = {
    "aten.amax", "aten.amin", "aten.sum", "aten.mean", "aten.var", "aten.var_mean", "aten.std",
    "aten.logsumexp", "aten.max", "aten.min",
}  # fmt: skip
_STATISTIC_OUTPUTS = {
    "aten.native_layer_norm": (1, 2), "aten.native_batch_norm": (1, 2, 3, 4),
    "aten._native_batch_norm_legit": (1, 2), "aten._native_batch_norm_legit_functional": (1, 2),
    "aten._native_batch_norm_legit_no_training": (1, 2), "aten.native_group_norm": (1, 2),
    "aten._fused_rms_norm": (1,), "aten.var_mean": (0, 1),
}  # fmt: skip
RELU = {"aten.relu"}
# BatchNorm on the batch's statistics, as the forward graph holds it: the op itself (aot_eager),
# or, decomposed (inductor), ``var_mean`` over every dimension but the channels' (dimension 1).
_BATCH_NORMS = {
    "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit",
    "aten.native_batch_norm",
}  # fmt: skip


def alias_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose value ``node`` is an alias of (``node`` itself if none)."""
    while op_name(node) in _ALIASES and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def is_returned(node: torch.fx.Node, graph: torch.fx.Graph) -> bool:
    """Whether ``node``, or the value it is an alias of, is an output the forward ``graph``
    returns to its caller, not a value it only saves for the backward."""
    returned = _RETURNED.get(graph)
    if returned is None:
        # The forward graph returns its caller's outputs, then the values it saves, in the
        # order AOTAutograd traces their hooks, and changes its outputs only after the last
        # one: at the first traced save, every output before that save's place is the
        # caller's, or a save not handed to the hooks (a parameter, never a reused buffer).
        outputs = list(graph.output_node().args[0])
        first = max((i for i, out in enumerate(outputs) if out is node), default=0)
        returned = _RETURNED[graph] = frozenset(
            out for out in outputs[:first] if isinstance(out, torch.fx.Node)
        )
    return alias_base(node) in returned


def op_name(node: torch.fx.Node) -> str:
    """The name of the op ``node`` calls without its overload: ``aten.mm``, ``prims.fma``."""
    return str(getattr(node.target, "overloadpacket", node.target))


# forward graph -> the nodes it returns to its caller (``is_returned``)
_RETURNED: weakref.WeakKeyDictionary[torch.fx.Graph, frozenset[torch.fx.Node]] = (
    weakref.WeakKeyDictionary()
)


def log_softmax_output(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes log-probabilities: ``log_softmax``, or its decomposition's last
    step ``x - log(s)``."""
    return op_name(node) == "aten._log_softmax" or less(node, "aten.log")


def less(node: Any, op: str) -> bool:
    """Whether ``node`` is ``a - b`` with ``b`` made by ``op``."""
    return (
        isinstance(node, torch.fx.Node)
        and op_name(node) == "aten.sub"
        and len(node.args) == 2
        and isinstance(node.args[1], torch.fx.Node)
        and op_name(node.args[1]) == op
    )


def less_a_saved_tensor(node: Any) -> bool:
    """Whether backward node ``node`` subtracts a saved tensor (a per-row maximum, a log-sum):
    ``exp`` of it is then a softmax recomputed from the scores or logits (inductor's
    decomposition of ``log_softmax``'s backward: ``exp(x - amax - log(sum))``), biased
    by ``exp`` of the rounded ``x`` (``E exp(x + ε) > exp(x)``; an output layer's gradient came
    out 0.23 off, as the log-domain rounding of NOTE [Log-probabilities] in decision_rules.py)."""
    todo = [node]
    while todo:
        current = todo.pop()
        if not isinstance(current, torch.fx.Node):
            continue
        op = op_name(current)
        subtrahend = current.args[1] if op == "aten.sub" and len(current.args) > 1 else None
        if isinstance(subtrahend, torch.fx.Node) and subtrahend.op == "placeholder":
            return True
        if op in _AFFINE or op in VIEWS:
            todo.extend(current.args)
    return False


def through_exp(use: torch.fx.Node, position: int, how: str) -> bool:
    """Whether ``use`` reads log-probabilities only through ``exp`` (``log_softmax``'s backward,
    or the ``exp`` of its decomposition) or only for their shape."""
    op = op_name(use)
    if op in SHAPE_READERS or use.op == "output":
        return True
    if how != SAME:
        return False
    return (op == "aten._log_softmax_backward_data" and position == 1) or op == "aten.exp"


def normalises(use: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether forward node ``use`` normalises ``node`` by its batch's per-channel statistics:
    a BatchNorm in training mode, or (decomposed) ``var_mean`` over all dimensions but 1."""
    if not use.args or use.args[0] is not node:
        return False
    op = op_name(use)
    if op in _BATCH_NORMS:  # ``training`` follows the running statistics, if it has them
        index = 3 if use.target is torch.ops.aten._native_batch_norm_legit.no_stats else 5
        return bool(use.args[index]) if len(use.args) > index else True
    if op != "aten.var_mean" or len(use.args) < 2 or not isinstance(use.args[1], Sequence):
        return False
    rank = node.meta["val"].dim() if "val" in node.meta else 0
    return rank >= 2 and sorted(d % rank for d in use.args[1]) == [d for d in range(rank) if d != 1]


def statistic(node: torch.fx.Node, depth: int = 0) -> bool:
    """Whether forward node ``node`` is a statistic: a reduction, a statistic output of a fused
    norm, or computed from statistics and constants alone (``rsqrt(var + eps)``,
    ``log(sum(exp))``), through views."""
    if node.op != "call_function" or depth > 8:
        return False
    op = op_name(node)
    if op in _REDUCTIONS:
        return True
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return node.args[1] in _STATISTIC_OUTPUTS.get(op_name(node.args[0]), ())
    inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    return bool(inputs) and all(statistic(a, depth + 1) for a in inputs)


def comparisons(use: torch.fx.Node, position: int) -> tuple[tuple[bool, float], ...] | None:
    """The comparisons ``use`` makes on its argument at ``position``, each as ``(strict, t)``
    (``x > t`` or ``x >= t``), as eager code's rules record them; ``None`` if it makes none; a
    threshold ``nan`` for a comparison with another tensor, which no exact mask records."""
    op = op_name(use)
    if op in RELU:
        return ((True, 0.0),)
    if op in _SIGNS:
        return ((True, 0.0), (False, 0.0))
    if op == "aten.leaky_relu_backward" and position == 1:  # the sign, as _LEAKY's rule
        return ((True, 0.0),)
    if op == "aten.hardsigmoid_backward" and position == 1:  # -3 < x < 3, as eager code's rule
        return ((True, -3.0), (False, 3.0))
    if op == "aten.threshold_backward" and position == 1 and constant_at(use, 2):
        return ((True, float(use.args[2])),)
    if op == "aten.hardtanh_backward" and position == 1:  # min < x < max, as _hardtanh's rule
        if constant_at(use, 2) and constant_at(use, 3):
            return ((True, float(use.args[2])), (False, float(use.args[3])))
        return ((True, math.nan),)
    if op in _COMPARISONS and position == 0 and constant_at(use, 1):
        return ((_COMPARISONS[op], float(use.args[1])),)
    if op == "aten.threshold_backward" or op in _COMPARISONS:
        return ((True, math.nan),)
    return None


def module_path(node: torch.fx.Node) -> str:
    """The qualified name of the innermost module that made ``node`` (``<root>`` if none)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<root>"
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)  # dynamo's name of the traced module
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).strip(".")
    return path or "<root>"


def find_placeholder(graph: torch.fx.Graph, name: str) -> torch.fx.Node:
    """The input of backward ``graph`` that carries the saved node ``name``."""
    for node in graph.find_nodes(op="placeholder"):
        if node.name == name:
            return node
    raise GactError(f"saved node {name!r} not found among the compiled backward's inputs")


def at_least_a_constant(node: object, exp: torch.fx.Node | None) -> bool:
    """Whether ``node`` is ``exp(...) + c`` with a constant ``c > 0``, which no rounding brings
    near 0: a sigmoid written as ``1 / (1 + exp(-x))`` (torch 2.11's inductor decomposes SiLU
    so), whose divisor is as smooth a use as ``aten.sigmoid`` (NOTE [Decisions from the backward
    graph] in compiled_sites.py). ``exp``: the saved tensor's placeholder, where the saved tensor
    is itself an exponential."""
    if not isinstance(node, torch.fx.Node) or op_name(node) != "aten.add" or node.kwargs:
        return False
    if len(node.args) != 2:
        return False
    a, b = node.args
    term, constant = (a, b) if isinstance(b, (int, float)) else (b, a)
    if not isinstance(constant, (int, float)) or not constant > 0:
        return False
    while isinstance(term, torch.fx.Node) and op_name(term) in VIEWS:
        term = term.args[0]
    return isinstance(term, torch.fx.Node) and (term is exp or op_name(term) == "aten.exp")


# How a use reaches the saved tensor: directly (through views), through a ReLU of it, or
# through any other recomputation of the forward in the backward.
SAME, RELU_OF, _DERIVED = "same", "relu", "derived"


def uses_of(node: torch.fx.Node) -> list[tuple[torch.fx.Node, int, str]]:
    """The non-view uses of ``node`` as ``(use, argument position, how it is reached)``,
    followed through views and through what the backward recomputes from it (nodes no
    tangent feeds: ``abs(h) + 1``, or a checkpointed block's ``relu(x @ w)``), whose own uses
    decide as well: a recomputed divisor is still a divisor, a recomputed ReLU still decides."""
    fed = _tangent_fed(node.graph)
    out, todo, seen = [], [(node, SAME)], set()
    while todo:
        current, how = todo.pop()
        for user in current.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op != "call_function":
                out.append((user, -1, how))
            elif op_name(user) in _PASSED_ON or user.target is operator.getitem:
                todo.append((user, how))
            else:
                position = next((i for i, a in enumerate(user.args) if a is current), -1)
                out.append((user, position, how))
                if op_name(user) in RELU and how != _DERIVED:
                    todo.append((user, RELU_OF))
                elif user not in fed:
                    todo.append((user, _DERIVED))
    return out


_FED: weakref.WeakKeyDictionary[torch.fx.Graph, set[torch.fx.Node]] = weakref.WeakKeyDictionary()


def _tangent_fed(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a backward graph that depend on its tangents (the gradient computation;
    the others recompute the forward)."""
    fed = _FED.get(graph)
    if fed is None:
        todo = [n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
        fed = set(todo)
        while todo:
            for user in todo.pop().users:
                if user not in fed:
                    fed.add(user)
                    todo.append(user)
        _FED[graph] = fed
    return fed


# Random draws: a comparison of one (inductor's dropout mask) decides nothing of an activation.
_RANDOM = {
    "aten.rand", "aten.rand_like", "aten.bernoulli", "aten.uniform", "aten.native_dropout",
    "prims.inductor_random", "rngprims.philox_rand",
}  # fmt: skip


def decision_mask(node: torch.fx.Node) -> bool:
    """Whether ``node`` compares a floating-point tensor the forward computed (no random draw)
    with a constant: a decision of an activation (NOTE [Decision-only saves] in saved.py)."""
    if op_name(node) not in _COMPARISONS or not constant_at(node, 1):
        return False
    source = node.args[0]
    if not isinstance(source, torch.fx.Node):
        return False
    value = source.meta.get("val")
    floating = isinstance(value, torch.Tensor) and value.is_floating_point()
    return floating and op_name(alias_base(source)) not in _RANDOM


def constant_at(node: torch.fx.Node, position: int) -> bool:
    return len(node.args) > position and isinstance(node.args[position], (int, float))


def numel_of(shape: Sequence[Any]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
