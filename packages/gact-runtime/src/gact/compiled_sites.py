"""What a ``torch.compile``d graph's saves are: each saved node's decision, read off the
compiled backward graph (NOTE [Decisions from the backward graph]); used by compiled.py."""

from __future__ import annotations

import itertools
import math
import operator
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gact_kernels
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from .decision_rules import ATTENTION_BITS
from .errors import GactError
from .scope import dtype_name

if TYPE_CHECKING:
    from .hooks import SaveHooks

__all__ = ["VIEWS", "CompiledSite", "SaveOutputs", "add_kept", "kept_sites", "op_name"]

# NOTE [Decisions from the backward graph]
# A compiled forward runs no Python per op, so ``DecisionMode`` sees nothing, and the
# partitioner, not the model, chooses what is saved (often a pre-activation from which the
# backward recomputes a ReLU). The backward graph says how each saved tensor is read:
# ``CompiledSite.of`` follows the saved node through views and through what the backward
# recomputes from it (nodes no tangent feeds) to the aten ops that read it.
# - Linear and smooth uses (matmuls, convolution and norm backwards, products, sums, exp, erf,
#   GELU/SiLU/tanh/sigmoid backwards, GELU and SiLU recomputed (a gated MLP's ``silu(gate)``,
#   which aot_eager's backward recomputes from the gate), softmax backwards, ops reading only
#   the shape) are compressed, as eager code compresses the saves of these functions.
# - A comparison with a constant made on the saved tensor itself (``relu``,
#   ``threshold_backward``, ``gt``/``ge``/``lt``/``le``, the sign read by ``abs``/``sgn``) becomes
#   an exact predicate, its 1-bit mask projecting the unpacked values (NOTE [Exact decisions] in
#   decisions.py; the whole compiled backward is the consumer), or the zero-exact grid for a
#   ReLU's own output; comparisons with 0 on the ReLU of the saved tensor are the same predicate.
# - A decision the backward *recomputes* from the saved tensor through anything else (a
#   BatchNorm + ReLU, a checkpointed block's ``relu(x @ w)``), a comparison with another tensor,
#   a divisor (recomputed or not), a reciprocal and a use GACT does not know keep the tensor as
#   it is: rounding it would make the decision on rounded values, biased, not noisy (the 26% of
#   NOTE [Checkpointed regions] in hooks.py), and a divisor near 0 turns rounding into unbounded
#   error. A divisor ``exp(...) + c`` with ``c > 0`` is never near 0: ``1 / (1 + exp(-x))`` is
#   a sigmoid (torch 2.11's inductor writes SiLU's backward so), a smooth use. Per-row
#   statistics (a trailing dimension of 1) are kept like eager code's; fused attention gives q
#   and k their floor and keeps its log-sum-exp; a LayerNorm input read by its backward gets
#   row groups.
# ``report()`` lists every kept compiled save with its reason; an unknown use is warned once.


# NOTE [Saved outputs]
# Inductor's partitioner recomputes cheap pointwise ops in the backward rather than save their
# outputs, and four of them then read a rounded save where eager code reads an unbiased one:
# - a ReLU after a BatchNorm, recomputed from the convolution's output: its decision is taken
#   on that recomputed value, so the output must be kept as it is (a recomputed decision,
#   above). On the ResNet-18 layout at L2 that kept the stem's pre-activation, its largest
#   tensor: 3.44x less stored than fp32, where eager code stores 7.91x less;
# - a softmax (attention's), recomputed from the scores through ``exp``: ``exp`` of a rounded
#   score is biased, so the scores must be kept (``_less_a_saved_tensor``);
# - ``log_softmax`` (a loss inside the model), whose backward reads ``exp`` of its output, which
#   it recomputes from the logits the same way;
# - a clamp (ReLU6: ``clamp_max(clamp_min(x, 0), 6)``) after a BatchNorm, whose backward decides
#   on its input, recomputed like the ReLU's (MobileNetV2: 2.07x, eager code 4.37x).
# While GACT's hooks are installed, inductor's joint-graph pass ``SaveOutputs`` marks these
# outputs of the forward ``MUST_SAVE`` (the partitioner's own tag for what activation
# checkpointing must keep): every ReLU's, every decomposed softmax's ``exp(x - amax(x))`` (not
# a sigmoid's ``exp(-x)``, a smooth use), every decomposed ``log_softmax``'s ``x - log(s)``,
# and every clamp's input. The backward then reads the ReLU's output, stored on the zero-exact
# grid, the softmax's numerator, read linearly, the log-probabilities, stored as probabilities
# (NOTE [Log-probabilities] in decision_rules.py), and the clamp's decision mask, saved exactly; the
# pre-activations, scores and logits are compressed like any other save. Same ResNet: 7.65x; a
# RoBERTa's attention scores are no longer kept (7.18x against 5.23x, eager code 6.95x);
# MobileNetV2 4.58x. The setting is global while any GACT hooks are installed, like
# AOTAutograd's filtering mode: a graph compiled then for another model saves these outputs
# too: one more activation per such op that its partitioner would have recomputed. Code
# compiled with no GACT installed is partitioned as before, a pass the user set is left alone
# (``compiled.CompileSettings``), and aot_eager's partitioner recomputes nothing.
class SaveOutputs(CustomGraphPass):
    """Inductor joint-graph pass: the outputs of ``aten.relu`` and of decomposed ``softmax``
    and ``log_softmax``, and the inputs of clamps, are saved, not recomputed (NOTE [Saved
    outputs])."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if (
                op_name(node) == "aten.relu"
                or _softmax_numerator(node)
                or _log_softmax_output(node)
            ):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            elif op_name(node) in _CLAMPS and isinstance(node.args[0], torch.fx.Node):
                if node.args[0].op == "call_function":  # the input its backward decides on
                    node.args[0].meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self) -> str:
        return "gact.SaveOutputs.4"


# Clamps (ReLU6 is ``clamp_max(clamp_min(x, 0), 6)``), whose backward decides on their input.
_CLAMPS = {"aten.clamp", "aten.clamp_min", "aten.clamp_max", "aten.hardtanh"}


def _softmax_numerator(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a decomposed softmax's ``exp(x - amax(x))`` (not any ``exp``: a
    sigmoid's ``exp(-x)`` is recomputed as before)."""
    return op_name(node) == "aten.exp" and bool(node.args) and _less(node.args[0], "aten.amax")


def _log_softmax_output(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes log-probabilities: ``log_softmax``, or its decomposition's last
    step ``x - log(s)``."""
    return op_name(node) == "aten._log_softmax" or _less(node, "aten.log")


def _less(node: Any, op: str) -> bool:
    """Whether ``node`` is ``a - b`` with ``b`` made by ``op``."""
    return (
        isinstance(node, torch.fx.Node)
        and op_name(node) == "aten.sub"
        and len(node.args) == 2
        and isinstance(node.args[1], torch.fx.Node)
        and op_name(node.args[1]) == op
    )


# Ops whose result always shares its argument's storage (``_aliased`` follows only these).
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
_SHAPE_READERS = {
    "aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.sym_size",
    "aten.sym_stride", "aten.sym_numel",
    "aten.max_pool2d_with_indices_backward", "aten.max_pool3d_with_indices_backward",
    "aten.avg_pool2d_backward", "aten.avg_pool3d_backward", "aten._adaptive_avg_pool2d_backward",
    "aten.nll_loss_backward", "aten.nll_loss2d_backward",
}  # fmt: skip
# Uses whose result is linear in the tensor or a smooth function of it, or reads its shape:
# compressed, as eager code compresses the saves of these functions' inputs and outputs.
_TOLERANT = _SHAPE_READERS | {
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
_ATTENTION = {
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": ((1, 2), 5),
    "aten._scaled_dot_product_flash_attention_backward": ((1, 2), 5),
    "aten._scaled_dot_product_efficient_attention_backward": ((1, 2), 6),
    "aten._scaled_dot_product_cudnn_attention_backward": ((1, 2), 5),
    "aten._efficient_attention_backward": ((1, 2), 7),
    "aten._flash_attention_backward": ((1, 2), 5),
}
_RECIPROCALS = {"aten.rsqrt", "aten.reciprocal"}
# Outputs whose backward divides by the inputs or shares the gradient among ties (NOTE [Exact
# decisions] in decisions.py): kept, as eager code keeps the saves of these calls.
_TIES_OR_PRODUCTS = {
    "aten.prod", "aten.cumprod", "aten.scatter_reduce", "aten.index_reduce",
    "aten.segment_reduce",
}  # fmt: skip
# Backward uses that find ties (``eq``: a maximum's gradient shared among the values equal to
# it), multiply the other inputs of a product together (dividing by one where none is 0) or
# divide by distances: kept, as eager code keeps these calls' saves.
_TIES_OR_DIVISIONS = {
    "aten.eq", "aten.ne", "aten.prod", "aten.cumprod", "aten.scatter_reduce",
    "aten._cdist_backward", "aten._pdist_backward", "aten._segment_reduce_backward",
}  # fmt: skip
# Statistics a backward recomputes (inductor's BatchNorm on small maps): a variance computed
# from rounded values is biased upwards by the rounding's own variance.
_VARIANCES = {"aten.var_mean", "aten.var", "aten.std", "aten.std_mean"}
_MATMULS = {"aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten.convolution_backward"}
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
_RELU = {"aten.relu"}
# BatchNorm on the batch's statistics, as the forward graph holds it: the op itself (aot_eager),
# or, decomposed (inductor), ``var_mean`` over every dimension but the channels' (dimension 1).
_BATCH_NORMS = {
    "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit",
    "aten.native_batch_norm",
}  # fmt: skip
_STORABLE = frozenset({torch.bool, *gact_kernels.FLOAT_DTYPES, *gact_kernels.INT_DTYPES})


def _aliased(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose value ``node`` is an alias of (``node`` itself if none)."""
    while op_name(node) in _ALIASES and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _returned(node: torch.fx.Node, graph: torch.fx.Graph) -> bool:
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
    return _aliased(node) in returned


def op_name(node: torch.fx.Node) -> str:
    """The name of the op ``node`` calls without its overload: ``aten.mm``, ``prims.fma``."""
    return str(getattr(node.target, "overloadpacket", node.target))


@dataclass(frozen=True, eq=False)
class CompiledSite:
    """How one tensor saved by a compiled graph is stored, decided when the graph is traced.

    Args:
        owner: a weak reference to the ``SaveHooks`` of the controller whose model saved it
            (``hooks`` dereferences it): the registry of traced sites lives as long as the
            process, and must not keep a controller, nor through it a model, alive.
        key: its save-site key: ``<module>@<node>:<dtype>:<rank>d``.
        dtype, device: the saved tensor's (for the unpacked tensor's fake value).
        graph: which traced forward graph saves it (numbered in tracing order).
        keep: why it is kept as it is, or ``None`` if it is compressed.
        predicates: ``(strict, t)`` comparisons its backward makes (see ``DecisionSpec``).
        zero_exact: a ReLU output read by ``x > 0``: stored on the zero-exact grid.
        decisions_only: its backward reads it only through ``predicates`` (or ``x > 0``
            where ``zero_exact``) and for its shape: stored as their outcomes alone where no
            other save reads it (NOTE [Decision-only saves] in saved.py).
        decided: a bool tensor the forward made by comparing an activation with a constant
            (inductor saves a ReLU's ``le`` mask): counted as a decision-only save is.
        min_bits: its smallest width (fused attention's q and k).
        row_length: LayerNorm rows: groups never span two rows of this many elements (0: none).
        batch_norm_input: normalised by its batch's statistics per channel (NOTE [Small maps] in
            decision_rules.py: on small maps it then takes more bits, as in eager code).
        like: a meta tensor like the saved one (static shapes only): a kept site is counted
            in the ledger with it whenever its graph runs (``SaveHooks.pack_site``).
        graph_input: the saved node is an input of its graph, which may be a parameter
            (``SaveHooks.pack_site`` checks it; intermediates never are).
        input_view: the saved node is a view of an input of its graph, which may be a view of
            a parameter (a weight's transpose, which eager code keeps as the parameter it is
            a view of: ``SaveHooks.pack_site`` checks it too).
        graph_output: the saved node is, or is a view of, an output of its graph: a tensor the
            code around the graph holds and may save again (NOTE [Boundary saves] in live.py).
        log_probabilities: ``log_softmax``'s output, read only through ``exp``: stored as
            probabilities, as eager code stores it (NOTE [Log-probabilities] in decision_rules.py).
    """

    owner: weakref.ref[SaveHooks]
    key: str
    dtype: torch.dtype
    device: torch.device
    graph: int
    keep: str | None
    predicates: tuple[tuple[bool, float], ...] = ()
    zero_exact: bool = False
    decisions_only: bool = False
    decided: bool = False
    min_bits: int = 0
    row_length: int = 0
    batch_norm_input: bool = False
    like: torch.Tensor | None = None
    graph_input: bool = False
    input_view: bool = False
    log_probabilities: bool = False
    graph_output: bool = False

    @property
    def hooks(self) -> SaveHooks:
        """The ``SaveHooks`` that traced this site.

        Raises:
            GactError: its controller no longer exists (a compiled graph outlived it).
        """
        hooks = self.owner()
        if hooks is None:
            raise GactError(
                f"a compiled graph saved {self.key!r} through the hooks of a GACT Controller "
                "that no longer exists; call torch._dynamo.reset() after dropping a Controller "
                "whose model was compiled, or keep the Controller for as long as the compiled "
                "model runs"
            )
        return hooks

    @classmethod
    def of(cls, hooks: SaveHooks, val: torch.Tensor, context: dict[str, Any]) -> CompiledSite:
        """Decide how to store the saved node named by ``context`` (see NOTE above)."""
        node: torch.fx.Node = context["_node"]
        key = f"{_module_path(node)}@{node.name}:{dtype_name(val.dtype)}"
        key += f":{val.dim()}d"
        site = dict(owner=weakref.ref(hooks), key=key, dtype=val.dtype, device=val.device)
        site["graph"] = _graph_number(context["_fw_graph"])
        site["graph_input"] = node.op in ("placeholder", "get_attr")
        site["input_view"] = not site["graph_input"] and _aliased(node).op in (
            "placeholder", "get_attr",
        )  # fmt: skip
        site["graph_output"] = _returned(node, context["_fw_graph"])
        if all(isinstance(n, int) for n in val.shape):
            site["like"] = torch.empty(val.shape, dtype=val.dtype, device="meta")
        config = hooks.plan.config
        if not config.spec.compresses:
            return cls(keep=f"level {config.level} compresses nothing", **site)
        if val.dtype not in _STORABLE:
            return cls(keep=f"{val.dtype} is not stored compressed", **site)
        numel = val.numel()
        if isinstance(numel, int) and numel < config.min_numel:
            return cls(keep=f"fewer than min_numel={config.min_numel} elements", **site)
        if not val.is_floating_point():  # bool and integer tensors: packed losslessly
            return cls(keep=None, decided=_decision_mask(_aliased(node)), **site)
        made_by = op_name(_aliased(node))
        if made_by in _RECIPROCALS:
            return cls(keep="a reciprocal (divides in the backward)", **site)
        if made_by in _TIES_OR_PRODUCTS or (
            made_by == "aten.pow" and isinstance(_aliased(node).args[1], torch.fx.Node)
        ):  # (a power with a tensor exponent: as eager code keeps its saves)
            return cls(keep=f"made by {made_by} (ties or divisions in the backward)", **site)
        placeholder = _placeholder(context["_bw_graph"], node.name)
        uses = _uses(placeholder)
        # the saved tensor itself, where it is an exponential (aot_eager saves exp(-h) of a
        # written-out sigmoid): a divisor it plus a constant makes is never near 0
        exp = placeholder if op_name(_aliased(node)) == "aten.exp" else None
        if _statistic(node) and not any(op_name(u) in _MATMULS for u, _, how in uses):
            return cls(keep="a per-row statistic", **site)  # not features pooled for a layer
        if _log_softmax_output(_aliased(node)):  # NOTE [Log-probabilities] in decision_rules.py
            if all(_through_exp(use, position, how) for use, position, how in uses):
                return cls(keep=None, log_probabilities=True, **site)
            return cls(keep="log-probabilities, read through exp and otherwise", **site)
        predicates: set[tuple[bool, float]] = set()
        min_bits = row_length = 0
        values = False  # whether a use reads its values (not only decisions and its shape)
        for use, position, how in uses:
            op = op_name(use)
            if op == "aten.exp" and _less_a_saved_tensor(use.args[0]):
                return cls(keep="a softmax recomputed from it reads it through exp", **site)
            values = values or (op not in _SHAPE_READERS and _decisions(use, position) is None)
            if op in _TOLERANT or use.op == "output":
                continue
            if op == "aten.div":
                if position == 1 and not _at_least_a_constant(use.args[1], exp):
                    return cls(keep="a divisor", **site)
                continue
            if op in _RECIPROCALS:
                if not _at_least_a_constant(use.args[0], exp):
                    return cls(keep="a divisor", **site)
                continue
            if op in _TIES_OR_DIVISIONS:
                return cls(keep=f"{op} finds ties, or divides by it", **site)
            if op in _VARIANCES:
                return cls(keep=f"a variance recomputed from it ({op})", **site)
            if op == "aten._log_softmax_backward_data":  # exp of rounded log-probabilities
                # (a save that log_softmax did not make: its exp is not stored)
                return cls(keep="log-probabilities, read through exp", **site)
            if op == "aten.pow":  # x ** p: unbounded near 0 for p < 0; p ** x is smooth
                if position == 0 and not (_constant(use, 1) and use.args[1] >= 0):
                    return cls(keep="a divisor", **site)
                continue
            found = _decisions(use, position)
            if found is not None:
                if any(math.isnan(t) for _, t in found):
                    return cls(keep=f"compared with another tensor by {op}", **site)
                if how == _SAME or (how == _RELU_OF and all(t == 0.0 for _, t in found)):
                    predicates.update(found)
                else:
                    return cls(keep=f"a recomputed decision ({op}) reads it", **site)
            elif op in _ATTENTION:
                precise, lse = _ATTENTION[op]
                if position == lse:
                    return cls(keep="fused attention's log-sum-exp", **site)
                if position in precise:
                    min_bits = ATTENTION_BITS
            elif op == "aten.native_layer_norm_backward" and position == 1:
                row_length = _numel(use.args[2]) if how == _SAME else 0
            elif op == "aten.native_layer_norm_backward":
                return cls(keep="LayerNorm's statistics", **site)
            else:
                return cls(keep=f"read by {op} in the compiled backward", **site)
        zero_exact = predicates == {(True, 0.0)} and op_name(_aliased(node)) in _RELU
        return cls(
            keep=None,
            predicates=() if zero_exact else tuple(sorted(predicates)),
            zero_exact=zero_exact,
            decisions_only=bool(predicates) and not values,
            min_bits=min_bits,
            row_length=row_length,
            batch_norm_input=any(_normalises(use, node) for use in node.users),
            **site,
        )

    @property
    def unknown_use(self) -> bool:
        """Kept because GACT does not know how its backward reads it (warned once)."""
        return self.keep is not None and self.keep.startswith("read by")


def _less_a_saved_tensor(node: Any) -> bool:
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


def _through_exp(use: torch.fx.Node, position: int, how: str) -> bool:
    """Whether ``use`` reads log-probabilities only through ``exp`` (``log_softmax``'s backward,
    or the ``exp`` of its decomposition) or only for their shape."""
    op = op_name(use)
    if op in _SHAPE_READERS or use.op == "output":
        return True
    if how != _SAME:
        return False
    return (op == "aten._log_softmax_backward_data" and position == 1) or op == "aten.exp"


def _normalises(use: torch.fx.Node, node: torch.fx.Node) -> bool:
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


def _statistic(node: torch.fx.Node, depth: int = 0) -> bool:
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
    return bool(inputs) and all(_statistic(a, depth + 1) for a in inputs)


def _decisions(use: torch.fx.Node, position: int) -> tuple[tuple[bool, float], ...] | None:
    """The comparisons ``use`` makes on its argument at ``position``, each as ``(strict, t)``
    (``x > t`` or ``x >= t``), as eager code's rules record them; ``None`` if it makes none; a
    threshold ``nan`` for a comparison with another tensor, which no exact mask records."""
    op = op_name(use)
    if op in _RELU:
        return ((True, 0.0),)
    if op in _SIGNS:
        return ((True, 0.0), (False, 0.0))
    if op == "aten.leaky_relu_backward" and position == 1:  # the sign, as _LEAKY's rule
        return ((True, 0.0),)
    if op == "aten.hardsigmoid_backward" and position == 1:  # -3 < x < 3, as eager code's rule
        return ((True, -3.0), (False, 3.0))
    if op == "aten.threshold_backward" and position == 1 and _constant(use, 2):
        return ((True, float(use.args[2])),)
    if op == "aten.hardtanh_backward" and position == 1:  # min < x < max, as _hardtanh's rule
        if _constant(use, 2) and _constant(use, 3):
            return ((True, float(use.args[2])), (False, float(use.args[3])))
        return ((True, math.nan),)
    if op in _COMPARISONS and position == 0 and _constant(use, 1):
        return ((_COMPARISONS[op], float(use.args[1])),)
    if op == "aten.threshold_backward" or op in _COMPARISONS:
        return ((True, math.nan),)
    return None


def _module_path(node: torch.fx.Node) -> str:
    """The qualified name of the innermost module that made ``node`` (``<root>`` if none)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<root>"
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)  # dynamo's name of the traced module
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).strip(".")
    return path or "<root>"


def _placeholder(graph: torch.fx.Graph, name: str) -> torch.fx.Node:
    for node in graph.find_nodes(op="placeholder"):
        if node.name == name:
            return node
    raise GactError(f"saved node {name!r} not found among the compiled backward's inputs")


def _at_least_a_constant(node: object, exp: torch.fx.Node | None) -> bool:
    """Whether ``node`` is ``exp(...) + c`` with a constant ``c > 0``, which no rounding brings
    near 0: a sigmoid written as ``1 / (1 + exp(-x))`` (torch 2.11's inductor decomposes SiLU
    so), whose divisor is as smooth a use as ``aten.sigmoid`` (NOTE above). ``exp``: the
    saved tensor's placeholder, where the saved tensor is itself an exponential."""
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
_SAME, _RELU_OF, _DERIVED = "same", "relu", "derived"


def _uses(node: torch.fx.Node) -> list[tuple[torch.fx.Node, int, str]]:
    """The non-view uses of ``node`` as ``(use, argument position, how it is reached)``,
    followed through views and through what the backward recomputes from it (nodes no
    tangent feeds: ``abs(h) + 1``, or a checkpointed block's ``relu(x @ w)``), whose own uses
    decide as well: a recomputed divisor is still a divisor, a recomputed ReLU still decides."""
    fed = _tangent_fed(node.graph)
    out, todo, seen = [], [(node, _SAME)], set()
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
                if op_name(user) in _RELU and how != _DERIVED:
                    todo.append((user, _RELU_OF))
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


def _decision_mask(node: torch.fx.Node) -> bool:
    """Whether ``node`` compares a floating-point tensor the forward computed (no random draw)
    with a constant: a decision of an activation (NOTE [Decision-only saves] in saved.py)."""
    if op_name(node) not in _COMPARISONS or not _constant(node, 1):
        return False
    source = node.args[0]
    if not isinstance(source, torch.fx.Node):
        return False
    value = source.meta.get("val")
    floating = isinstance(value, torch.Tensor) and value.is_floating_point()
    return floating and op_name(_aliased(source)) not in _RANDOM


def _constant(node: torch.fx.Node, position: int) -> bool:
    return len(node.args) > position and isinstance(node.args[position], (int, float))


def _numel(shape: Sequence[Any]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


_NUMBERS: weakref.WeakKeyDictionary[torch.fx.Graph, int] = weakref.WeakKeyDictionary()
_KEPT: dict[int, list[CompiledSite]] = {}  # graph number -> its sites kept as they are
_GRAPH_NUMBERS = itertools.count(1)
# forward graph -> the nodes it returns to its caller (``_returned``)
_RETURNED: weakref.WeakKeyDictionary[torch.fx.Graph, frozenset[torch.fx.Node]] = (
    weakref.WeakKeyDictionary()
)


def _graph_number(graph: torch.fx.Graph) -> int:
    number = _NUMBERS.get(graph)
    if number is None:
        number = _NUMBERS[graph] = next(_GRAPH_NUMBERS)
        _KEPT[number] = []
    return number


def kept_sites(graph: int) -> list[CompiledSite]:
    """The sites of traced forward graph ``graph`` kept as they are (those of static shape,
    which the ledger counts whenever the graph runs)."""
    return _KEPT.get(graph, [])


def add_kept(site: CompiledSite) -> None:
    """Count ``site``, kept as it is, with the other kept sites of its graph."""
    if site.keep is not None and site.like is not None:
        _KEPT[site.graph].append(site)
