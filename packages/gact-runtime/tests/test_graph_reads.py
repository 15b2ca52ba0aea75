"""How a compiled graph reads a saved node (gact/graph_reads.py), on small hand-built fx graphs:
each predicate's positive case beside the near miss that must not pass."""

from __future__ import annotations

import math
import operator

import pytest
import torch
from gact import GactError
from gact.graph_reads import (
    RELU_OF,
    SAME,
    alias_base,
    at_least_a_constant,
    comparisons,
    decision_mask,
    find_placeholder,
    is_returned,
    less_a_saved_tensor,
    log_softmax_output,
    module_path,
    normalises,
    op_name,
    statistic,
    uses_of,
)

aten = torch.ops.aten


def _graph() -> tuple[torch.fx.Graph, torch.fx.Node]:
    graph = torch.fx.Graph()
    return graph, graph.placeholder("x")


def test_op_name_drops_the_overload() -> None:
    graph, x = _graph()
    assert op_name(graph.call_function(aten.mm.default, (x, x))) == "aten.mm"
    assert op_name(x) == "x"  # a placeholder's target is its name


@pytest.mark.parametrize(
    "target,args,expected",
    [
        (aten.relu.default, (), ((True, 0.0),)),
        (aten.gt.Scalar, (0.5,), ((True, 0.5),)),
        (aten.le.Scalar, (0.5,), ((True, 0.5),)),  # x <= t is the negation of x > t
        (aten.ge.Scalar, (-1.0,), ((False, -1.0),)),
        (aten.abs.default, (), ((True, 0.0), (False, 0.0))),
        (aten.mul.Tensor, (2.0,), None),  # a linear use decides nothing
    ],
)
def test_comparisons_with_constants(target: object, args: tuple, expected: object) -> None:
    graph, x = _graph()
    assert comparisons(graph.call_function(target, (x, *args)), 0) == expected


def test_a_comparison_with_a_tensor_has_no_threshold() -> None:
    graph, x = _graph()
    other = graph.placeholder("y")
    ((strict, threshold),) = comparisons(graph.call_function(aten.gt.Tensor, (x, other)), 0)
    assert strict and math.isnan(threshold)


def test_hardtanh_backward_reads_both_bounds_of_its_input_only() -> None:
    graph, x = _graph()
    grad = graph.placeholder("g")
    use = graph.call_function(aten.hardtanh_backward.default, (grad, x, -1.0, 6.0))
    assert comparisons(use, 1) == ((True, -1.0), (False, 6.0))
    assert comparisons(use, 0) is None  # the gradient is not compared


def test_at_least_a_constant_is_exp_plus_a_positive_constant() -> None:
    graph, x = _graph()
    e = graph.call_function(aten.exp.default, (x,))
    viewed = graph.call_function(aten.view.default, (e, [-1]))
    assert at_least_a_constant(graph.call_function(aten.add.Tensor, (e, 1.0)), None)
    assert at_least_a_constant(graph.call_function(aten.add.Tensor, (1, viewed)), None)
    assert not at_least_a_constant(graph.call_function(aten.add.Tensor, (e, 0.0)), None)
    assert not at_least_a_constant(graph.call_function(aten.add.Tensor, (e, -1.0)), None)
    assert not at_least_a_constant(graph.call_function(aten.add.Tensor, (x, 1.0)), None)
    # the saved tensor itself may be the exponential
    assert at_least_a_constant(graph.call_function(aten.add.Tensor, (x, 1.0)), x)


def test_statistics_are_reductions_and_what_only_they_make() -> None:
    graph, x = _graph()
    var = graph.call_function(aten.var.correction, (x, [1]))
    rstd = graph.call_function(
        aten.rsqrt.default, (graph.call_function(aten.add.Tensor, (var, 1e-5)),)
    )
    assert statistic(rstd)
    assert not statistic(graph.call_function(aten.mul.Tensor, (rstd, x)))  # x normalised
    norm = graph.call_function(aten.native_layer_norm.default, (x, [8], None, None, 1e-5))
    assert statistic(graph.call_function(operator.getitem, (norm, 2)))
    assert not statistic(graph.call_function(operator.getitem, (norm, 0)))


def test_uses_are_followed_through_views_and_relus() -> None:
    graph, x = _graph()
    tangent = graph.placeholder("tangents_1")
    viewed = graph.call_function(aten.view.default, (x, [-1]))
    relu = graph.call_function(aten.relu.default, (viewed,))
    mm = graph.call_function(aten.mm.default, (tangent, relu))
    graph.output((mm,))
    found = {(op_name(use), position, how) for use, position, how in uses_of(x)}
    # relu reads x itself (through a view), mm reads relu(x)
    assert ("aten.relu", 0, SAME) in found
    assert ("aten.mm", 1, RELU_OF) in found
    assert not any(op == "aten.view" for op, _, _ in found)  # views are looked through


def test_less_a_saved_tensor_finds_a_softmax_recomputed_from_a_saved_maximum() -> None:
    graph, x = _graph()
    amax = graph.placeholder("amax")
    scaled = graph.call_function(aten.mul.Tensor, (x, 0.5))
    assert less_a_saved_tensor(graph.call_function(aten.sub.Tensor, (scaled, amax)))
    computed = graph.call_function(aten.amax.default, (x, [-1], True))
    assert not less_a_saved_tensor(graph.call_function(aten.sub.Tensor, (x, computed)))


def test_log_softmax_outputs_decomposed_or_not() -> None:
    graph, x = _graph()
    log_sum = graph.call_function(
        aten.log.default, (graph.call_function(aten.sum.dim_IntList, (x, [1])),)
    )
    assert log_softmax_output(graph.call_function(aten.sub.Tensor, (x, log_sum)))
    assert log_softmax_output(graph.call_function(aten._log_softmax.default, (x, 1, False)))
    assert not log_softmax_output(graph.call_function(aten.sub.Tensor, (x, x)))


def test_batch_norm_inputs_are_normalised_per_channel() -> None:
    graph, x = _graph()
    x.meta["val"] = torch.empty(2, 3, 4, 4, device="meta")
    per_channel = graph.call_function(aten.var_mean.correction, (x, [0, 2, 3]))
    per_row = graph.call_function(aten.var_mean.correction, (x, [3]))
    assert normalises(per_channel, x)
    assert not normalises(per_row, x)
    bn = (x, None, None, None, None, True, 0.1, 1e-5)
    assert normalises(graph.call_function(aten.native_batch_norm.default, bn), x)
    frozen = (*bn[:5], False, *bn[6:])
    assert not normalises(graph.call_function(aten.native_batch_norm.default, frozen), x)


def test_alias_base_and_outputs_returned_to_the_caller() -> None:
    graph, x = _graph()
    h = graph.call_function(aten.relu.default, (x,))
    t = graph.call_function(aten.t.default, (graph.call_function(aten.view.default, (h, [4, 4])),))
    saved = graph.call_function(aten.exp.default, (h,))
    graph.output((h, saved))  # the caller's output first, then what the forward saves
    assert alias_base(t) is h
    # read at the first traced save: the outputs before its place are the caller's
    assert not is_returned(saved, graph)
    assert is_returned(t, graph)  # a view of the caller's output
    assert is_returned(h, graph)


def test_decision_masks_compare_computed_values_not_random_draws() -> None:
    graph, x = _graph()
    x.meta["val"] = torch.empty(4, device="meta")
    h = graph.call_function(aten.relu.default, (x,))
    h.meta["val"] = torch.empty(4, device="meta")
    draw = graph.call_function(aten.rand_like.default, (x,))
    draw.meta["val"] = torch.empty(4, device="meta")
    assert decision_mask(graph.call_function(aten.le.Scalar, (h, 0)))
    assert not decision_mask(graph.call_function(aten.gt.Scalar, (draw, 0.1)))  # dropout
    assert not decision_mask(graph.call_function(aten.gt.Tensor, (h, x)))


def test_module_path_from_dynamos_module_stack() -> None:
    graph, x = _graph()
    node = graph.call_function(aten.relu.default, (x,))
    assert module_path(node) == "<root>"
    node.meta["nn_module_stack"] = {
        "a": ("L['self'].layers[0]", object),
        "b": ("L['self'].layers[0]._modules['act']", object),
    }
    assert module_path(node) == "layers.0.act"


def test_a_missing_placeholder_names_the_node() -> None:
    graph, _ = _graph()
    assert find_placeholder(graph, "x").name == "x"
    with pytest.raises(GactError, match="'y' not found"):
        find_placeholder(graph, "y")
