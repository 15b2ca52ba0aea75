"""What a ``torch.compile``d graph's saves are: each saved node's decision, read off the
compiled backward graph (NOTE [Decisions from the backward graph]); used by compiled.py."""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gact_kernels
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from .attention import ATTENTION_BITS
from .errors import GactError
from .graph_reads import (
    ATTENTION,
    MATMULS,
    RECIPROCALS,
    RELU,
    RELU_OF,
    SAME,
    SHAPE_READERS,
    TIES_OR_DIVISIONS,
    TIES_OR_PRODUCTS,
    TOLERANT,
    VARIANCES,
    alias_base,
    at_least_a_constant,
    comparisons,
    constant_at,
    decision_mask,
    find_placeholder,
    is_returned,
    less,
    less_a_saved_tensor,
    log_softmax_output,
    module_path,
    normalises,
    numel_of,
    op_name,
    statistic,
    through_exp,
    uses_of,
)
from .scope import dtype_name

if TYPE_CHECKING:
    from .hooks import SaveHooks

__all__ = ["CompiledSite", "SaveOutputs", "add_kept", "kept_sites"]

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
#   NOTE [Checkpointed regions] in origins.py), and a divisor near 0 turns rounding into unbounded
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
#   score is biased, so the scores must be kept (``less_a_saved_tensor``);
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
            if op_name(node) == "aten.relu" or _softmax_numerator(node) or log_softmax_output(node):
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
    return op_name(node) == "aten.exp" and bool(node.args) and less(node.args[0], "aten.amax")


_STORABLE = frozenset({torch.bool, *gact_kernels.FLOAT_DTYPES, *gact_kernels.INT_DTYPES})


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
            norm_rules.py: on small maps it then takes more bits, as in eager code).
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
        key = f"{module_path(node)}@{node.name}:{dtype_name(val.dtype)}"
        key += f":{val.dim()}d"
        site = dict(owner=weakref.ref(hooks), key=key, dtype=val.dtype, device=val.device)
        site["graph"] = _graph_number(context["_fw_graph"])
        site["graph_input"] = node.op in ("placeholder", "get_attr")
        site["input_view"] = not site["graph_input"] and alias_base(node).op in (
            "placeholder", "get_attr",
        )  # fmt: skip
        site["graph_output"] = is_returned(node, context["_fw_graph"])
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
            return cls(keep=None, decided=decision_mask(alias_base(node)), **site)
        made_by = op_name(alias_base(node))
        if made_by in RECIPROCALS:
            return cls(keep="a reciprocal (divides in the backward)", **site)
        if made_by in TIES_OR_PRODUCTS or (
            made_by == "aten.pow" and isinstance(alias_base(node).args[1], torch.fx.Node)
        ):  # (a power with a tensor exponent: as eager code keeps its saves)
            return cls(keep=f"made by {made_by} (ties or divisions in the backward)", **site)
        placeholder = find_placeholder(context["_bw_graph"], node.name)
        uses = uses_of(placeholder)
        # the saved tensor itself, where it is an exponential (aot_eager saves exp(-h) of a
        # written-out sigmoid): a divisor it plus a constant makes is never near 0
        exp = placeholder if op_name(alias_base(node)) == "aten.exp" else None
        if statistic(node) and not any(op_name(u) in MATMULS for u, _, how in uses):
            return cls(keep="a per-row statistic", **site)  # not features pooled for a layer
        if log_softmax_output(alias_base(node)):  # NOTE [Log-probabilities] in decision_rules.py
            if all(through_exp(use, position, how) for use, position, how in uses):
                return cls(keep=None, log_probabilities=True, **site)
            return cls(keep="log-probabilities, read through exp and otherwise", **site)
        predicates: set[tuple[bool, float]] = set()
        min_bits = row_length = 0
        values = False  # whether a use reads its values (not only decisions and its shape)
        for use, position, how in uses:
            op = op_name(use)
            if op == "aten.exp" and less_a_saved_tensor(use.args[0]):
                return cls(keep="a softmax recomputed from it reads it through exp", **site)
            values = values or (op not in SHAPE_READERS and comparisons(use, position) is None)
            if op in TOLERANT or use.op == "output":
                continue
            if op == "aten.div":
                if position == 1 and not at_least_a_constant(use.args[1], exp):
                    return cls(keep="a divisor", **site)
                continue
            if op in RECIPROCALS:
                if not at_least_a_constant(use.args[0], exp):
                    return cls(keep="a divisor", **site)
                continue
            if op in TIES_OR_DIVISIONS:
                return cls(keep=f"{op} finds ties, or divides by it", **site)
            if op in VARIANCES:
                return cls(keep=f"a variance recomputed from it ({op})", **site)
            if op == "aten._log_softmax_backward_data":  # exp of rounded log-probabilities
                # (a save that log_softmax did not make: its exp is not stored)
                return cls(keep="log-probabilities, read through exp", **site)
            if op == "aten.pow":  # x ** p: unbounded near 0 for p < 0; p ** x is smooth
                if position == 0 and not (constant_at(use, 1) and use.args[1] >= 0):
                    return cls(keep="a divisor", **site)
                continue
            found = comparisons(use, position)
            if found is not None:
                if any(math.isnan(t) for _, t in found):
                    return cls(keep=f"compared with another tensor by {op}", **site)
                if how == SAME or (how == RELU_OF and all(t == 0.0 for _, t in found)):
                    predicates.update(found)
                else:
                    return cls(keep=f"a recomputed decision ({op}) reads it", **site)
            elif op in ATTENTION:
                precise, lse = ATTENTION[op]
                if position == lse:
                    return cls(keep="fused attention's log-sum-exp", **site)
                if position in precise:
                    min_bits = ATTENTION_BITS
            elif op == "aten.native_layer_norm_backward" and position == 1:
                row_length = numel_of(use.args[2]) if how == SAME else 0
            elif op == "aten.native_layer_norm_backward":
                return cls(keep="LayerNorm's statistics", **site)
            else:
                return cls(keep=f"read by {op} in the compiled backward", **site)
        zero_exact = predicates == {(True, 0.0)} and op_name(alias_base(node)) in RELU
        return cls(
            keep=None,
            predicates=() if zero_exact else tuple(sorted(predicates)),
            zero_exact=zero_exact,
            decisions_only=bool(predicates) and not values,
            min_bits=min_bits,
            row_length=row_length,
            batch_norm_input=any(normalises(use, node) for use in node.users),
            **site,
        )

    @property
    def unknown_use(self) -> bool:
        """Kept because GACT does not know how its backward reads it (warned once)."""
        return self.keep is not None and self.keep.startswith("read by")


_NUMBERS: weakref.WeakKeyDictionary[torch.fx.Graph, int] = weakref.WeakKeyDictionary()
_KEPT: dict[int, list[CompiledSite]] = {}  # graph number -> its sites kept as they are
_GRAPH_NUMBERS = itertools.count(1)


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
