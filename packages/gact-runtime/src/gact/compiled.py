"""Compressed saves inside ``torch.compile``d graphs.

GACT's saved-tensor hooks are ``torch.fx.GraphModule`` s, which AOTAutograd traces into the
compiled graphs: each tensor a compiled forward saves is packed in the forward's epilogue and
unpacked, just before its first use, in the compiled backward. Eager code calls the same hooks
as plain functions.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch._inductor.config
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from .compiled_sites import CompiledSite, SaveOutputs, add_kept
from .errors import GactError
from .graph_reads import VIEWS, op_name

if TYPE_CHECKING:
    from .hooks import SaveHooks
    from .saved import Saved

__all__ = [
    "COMPILED_NODE",
    "CompileClock",
    "CompileSettings",
    "SaveHookModule",
    "never_compiled",
    "pack_on_thread",
    "pack_traced",
    "tracing_context",
    "unpack_on_thread",
    "unpack_traced",
]

# NOTE [Compiled saves]
# A compiled backward used to unpack every saved tensor when it started (pytorch#148222), which
# brings all activations back at once: compressing them lowered no peak. Since pytorch#150032
# (in torch 2.11 and in the 2.13 this project pins) AOTAutograd inlines saved-tensor hooks that
# are ``torch.fx.GraphModule`` s into the compiled graphs
# (``maybe_inline_graph_saved_tensors_hooks``): it traces the pack hook on each saved tensor it
# hands over (a fake tensor, with ``_get_saved_tensor_hook_context()`` naming the saved node and
# both graphs) into the forward's epilogue, and the unpack hook into the backward's prologue.
# GACT's hooks are such modules (``SaveHookModule``; eager code calls them as plain functions).
# Four design decisions, each chosen over an alternative:
# - Handles, not payloads, cross the graph boundary. The traced pack hook emits one opaque
#   custom op, ``gact::pack_saved``, which at run time compresses the tensor through the eager
#   code path (``SaveHooks.pack_site``: same kernels, byte format, seeds, ledger, swap) and
#   returns a one-element int64 *handle* to the ``Saved`` it keeps in ``_PAYLOADS``;
#   ``gact::unpack_saved`` turns the handle back into the tensor. The payload's size depends on
#   the bit width, so returning payload tensors from the graph would bake every width into the
#   compiled code and recompile at each adaptation, and a payload's lossless groups have a
#   data-dependent size. With handles the widths are read from the plan at run time: adaptation
#   never recompiles. The entry lives as long as the handle tensor, which autograd holds exactly
#   as long as it would have held the saved tensor (``weakref.finalize``), so an abandoned graph
#   frees its payloads, and a second backward (``retain_graph=True``) finds them again.
# - Decisions come from the backward graph, not from ``DecisionMode``, when the graph is traced
#   (NOTE [Decisions from the backward graph] in compiled_sites.py).
# - Each save is packed right after it is computed and unpacked right before its first use.
#   AOTAutograd puts every pack at the forward's end and every unpack at the backward's start,
#   and neither backend moves an opaque op: all activations would be alive at once, as before.
#   ``_place_packs`` moves each ``pack_saved`` just after the node it packs (a saved view, which
#   the partitioner makes at the forward's end, just after its base), ``_place_unpacks`` each
#   ``unpack_saved`` just before its first user. Both run at every traced unpack, when its pack
#   is in the forward graph and the earlier unpacks in the backward one; the last unpack is
#   placed when the compiled forward first runs, before the backward is compiled (lazily, at
#   its first call; a backward compiled ahead of time, with dynamic shapes, keeps that one
#   unpack at its start). tests/test_compile.py proves the placement with the peak.
# - Each save keeps the layout the compiled code gives it. AOTAutograd traces the hooks on fake
#   tensors with eager strides (NCHW), while inductor lays a convolutional graph's activations
#   out channels-last: an op that fixed its input's stride order would make inductor write an
#   NCHW copy of every save for the pack (three full-size buffers per conv/BatchNorm/ReLU
#   block where fp32 has one), and an unpack returning NCHW would make it convert every
#   unpacked tensor back before the convolution's backward. So ``pack_saved`` takes any layout
#   (``flexible_layout``: the tensor as inductor has it, channels-last included; the kernels
#   restore its strides), and when the compiled forward first runs, before the backward is
#   compiled, each ``unpack_saved`` is told the strides its save really has (``_restride``:
#   inductor lowers the graph's nodes; their generated Python code, which aot_eager runs, is
#   left as it is, since eager kernels give a save its traced strides). A backward compiled
#   before that (ahead of time) keeps the traced strides: the unpack then copies into them.
# - A graph's saved inputs and outputs are compressed too. By default AOTAutograd hands only a
#   graph's intermediates to the hooks (``saved_tensors_hooks_filtering_mode="donated"``: the
#   others "may be held elsewhere"), so a model compiled block by block (``block.compile()``),
#   or split into a graph per layer by a graph break, kept every block's input as it is,
#   unseen by the ledger. While GACT's hooks are installed the mode is ``"no_static"``
#   (``CompileSettings``): everything but static inputs (parameters), as eager GACT compresses
#   every save; a parameter that still arrives is kept (``SaveHooks.pack_site``). A tensor
#   saved by one graph as its output and by the next as its input is stored once, as eager
#   code stores it (NOTE [Boundary saves] in live.py); ``Controller._on_compiled_return``
#   warns when a compiled forward's saves reached no hook at all.
# ``_SITES`` keeps the traced sites for the process's life (a compiled graph may run again as
# long as its hooks' ids are installed: dynamo's guard), but a site refers to its controller's
# hooks weakly, so that dropping a Controller and its model frees them (a graph that runs after
# its controller died raises ``GactError``).

#: The autograd node that unpacks every save of a compiled graph (the consumer of its decisions).
COMPILED_NODE = "CompiledFunctionBackward"

# ----------------------------------------------------------------- the ops in compiled graphs
_SITES: list[CompiledSite] = []  # site id -> site; a site is traced once per compiled graph
_PAYLOADS: dict[int, Saved] = {}  # handle -> what its save holds (see NOTE above)
# site -> the backward graph whose unpack of it has its traced strides (NOTE above)
_RESTRIDE: dict[int, weakref.ref[torch.fx.Graph]] = {}
_HANDLES = itertools.count(1)
_LOCK = threading.Lock()


@torch.library.custom_op("gact::pack_saved", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _pack_saved(tensor: torch.Tensor, site: int) -> torch.Tensor:
    """Compress ``tensor`` as site ``site`` says; returns its handle (see NOTE above)."""
    _flush_placements()
    entry = _SITES[site]
    saved = entry.hooks.pack_site(tensor, entry)
    graph = _RESTRIDE.pop(site, None)
    if graph is not None:
        _restride(graph(), site, saved.unpacked_stride())
    handle = torch.tensor([next(_HANDLES)], dtype=torch.int64)
    number = int(handle[0])
    with _LOCK:
        _PAYLOADS[number] = saved
    weakref.finalize(handle, _PAYLOADS.pop, number, None)
    return handle


@_pack_saved.register_fake
def _(tensor: torch.Tensor, site: int) -> torch.Tensor:
    return torch.empty((1,), dtype=torch.int64)


@torch.library.custom_op("gact::unpack_saved", mutates_args=())
def _unpack_saved(
    handle: torch.Tensor, site: int, shape: Sequence[int], stride: Sequence[int]
) -> torch.Tensor:
    """The tensor saved under ``handle``, with the saved tensor's shape and strides."""
    saved = _PAYLOADS.get(int(handle[0]))
    if saved is None:
        raise GactError(
            "a compiled backward asked for a saved tensor whose handle was freed; this is a "
            "GACT bug: please report it (uninstalling the Controller around torch.compile "
            "avoids it)"
        )
    values = _SITES[site].hooks.unpack(saved)
    if values.stride() != tuple(stride) or values._is_view():
        values = torch.empty_strided(shape, stride, dtype=values.dtype, device=values.device).copy_(
            values
        )
    return values


@_unpack_saved.register_fake
def _(handle: torch.Tensor, site: int, shape: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    entry = _SITES[site]
    return torch.empty_strided(shape, stride, dtype=entry.dtype, device=entry.device)


_PACK = torch.ops.gact.pack_saved.default
_UNPACK = torch.ops.gact.unpack_saved.default


# ----------------------------------------------------------------- tracing
try:  # since pytorch#150032; before, the hooks see compiled saves eagerly and keep them
    from torch._functorch._aot_autograd.graph_compile import (
        _get_saved_tensor_hook_context as _hook_context,
    )
except ImportError:  # pragma: no cover - depends on the torch version
    _hook_context = None


def tracing_context() -> dict[str, Any] | None:
    """The saved node being traced by AOTAutograd (``_fw_graph``, ``_bw_graph``, ``_node``),
    or ``None`` when the hooks run eagerly."""
    return None if _hook_context is None else _hook_context()


def pack_traced(hooks: SaveHooks, tensor: torch.Tensor, context: dict[str, Any]) -> Any:
    """The traced pack of a compiled graph's save: the tensor itself if it is kept, else
    ``(handle, site, sizes, (shape, stride))`` (``_symbolic_layout``)."""
    node: torch.fx.Node = context["_node"]
    site = node.meta.get("gact_site")
    if site is None:  # the first of AOTAutograd's two calls for this node
        entry = CompiledSite.of(hooks, tensor, context)
        with _LOCK:
            site = len(_SITES)
            _SITES.append(entry)
        node.meta["gact_site"] = site
        hooks.traced(entry)
        graph = context["_bw_graph"]
        if entry.keep is None and not any(g is graph for g in _PENDING):
            _PENDING.append(graph)  # once per graph, however many sites it has
        if entry.keep is None and entry.like is not None:  # static shapes: strides known
            _RESTRIDE[site] = weakref.ref(graph)
        add_kept(entry)
    if _SITES[site].keep is not None:
        return tensor
    handle = torch.ops.gact.pack_saved(tensor, site)
    sizes, layout = _symbolic_layout(tensor)
    return handle, site, sizes, layout


# A pack returns each symbolic size of its tensor's shape and strides once: AOTAutograd renames
# every symbolic value a pack returns (``<node>_hook_<i>``), and one returned twice (the ``T``
# of a (B, T, T) attention weight) it renamed the first time and lost the second, so the
# forward graph failed to compile ("'_safe_softmax_hook_4' ... used before it has been
# defined") as soon as dynamo made the sequence length dynamic.
def _symbolic_layout(
    tensor: torch.Tensor,
) -> tuple[tuple[Any, ...], tuple[tuple[int | str, ...], tuple[int | str, ...]]]:
    """The distinct symbolic sizes of ``tensor``'s shape and strides, and both as templates:
    an int stays, a symbolic size is ``"s<k>"`` (``k``: its place among the distinct ones)."""
    sizes: list[Any] = []
    places: dict[Any, str] = {}

    def template(values: tuple[Any, ...]) -> tuple[int | str, ...]:
        out: list[int | str] = []
        for value in values:
            if isinstance(value, int):
                out.append(value)
                continue
            key = value.node.expr
            if key not in places:
                places[key] = f"s{len(sizes)}"
                sizes.append(value)
            out.append(places[key])
        return tuple(out)

    layout = (template(tuple(tensor.shape)), template(tuple(tensor.stride())))
    return tuple(sizes), layout


def unpack_traced(packed: Any, context: dict[str, Any] | None) -> torch.Tensor:
    """The traced unpack of what ``pack_traced`` returned (``context``: see
    ``tracing_context``)."""
    if context is not None:  # this node's pack is in the forward graph; earlier unpacks too
        _place_packs(context["_fw_graph"])
        _place_unpacks(context["_bw_graph"])
    if isinstance(packed, torch.Tensor):
        return packed
    handle, site, sizes, (shape, stride) = packed

    def filled(template: tuple[int | str, ...]) -> list[Any]:
        return [sizes[int(v[1:])] if isinstance(v, str) else v for v in template]

    return torch.ops.gact.unpack_saved(handle, site, filled(shape), filled(stride))


# ----------------------------------------------------------------- placement
_PENDING: list[torch.fx.Graph] = []  # backward graphs whose unpacks may still need placing


def _place_packs(graph: torch.fx.Graph) -> None:
    """Move every ``pack_saved`` of ``graph`` just after the node it packs, and a saved view
    (which the partitioner may have made at the forward's end) just after its base: the base
    is freed once all its views are packed."""
    for node in [n for n in graph.nodes if n.target is _PACK]:
        chain, source = [], node.args[0]
        # a view that reads no other node (its shape may hold symbolic sizes computed in the
        # graph, ``view(x, [mul_16, 64])``: it stays after them)
        while op_name(source) in VIEWS and source.all_input_nodes == [source.args[0]]:
            chain.append(source)
            source = source.args[0]
        if source.op == "placeholder":  # a view of an input: packed where it is made
            chain, source = [], node.args[0]
        for moved in (*reversed(chain), node):
            if source.next is not moved:
                source.append(moved)
            source = moved


def _place_unpacks(graph: torch.fx.Graph) -> bool:
    """Move every ``unpack_saved`` of ``graph`` just before its first user; whether any moved."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    moved = False
    for node in [n for n in graph.nodes if n.target is _UNPACK]:
        if not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        if node.next is not first:
            first.prepend(node)
            moved = True
    return moved


def _restride(graph: torch.fx.Graph | None, site: int, stride: tuple[int, ...] | None) -> None:
    """Give ``site``'s unpacks in ``graph`` the strides its save has when the compiled forward
    runs (NOTE above), when they differ from the traced ones; ``None``: keep them."""
    if graph is None or stride is None:
        return
    for node in graph.nodes:
        if node.target is not _UNPACK or node.args[1] != site or tuple(node.args[3]) == stride:
            continue
        handle, _, shape, _ = node.args
        node.args = (handle, site, shape, list(stride))
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            with val.fake_mode:
                node.meta["val"] = torch.empty_strided(
                    shape, stride, dtype=val.dtype, device=val.device
                )


def _flush_placements() -> None:
    """Place the unpacks of the graphs traced since the last call (NOTE above)."""
    while _PENDING:
        graph = _PENDING.pop()
        if _place_unpacks(graph) and graph.owning_module is not None:
            graph.lint()
            graph.owning_module.recompile()


# ----------------------------------------------------------------- the hook modules
class SaveHookModule(torch.fx.GraphModule):
    """A saved-tensor hook that ``torch.compile`` can trace (NOTE [Compiled saves]).

    Eager code calls ``fn`` directly (no ``GraphModule`` call overhead); AOTAutograd calls the
    module on fake tensors, which runs ``fn`` too, so ``fn`` decides what goes in the graph.
    The module's own graph, a call of ``target``, is what dynamo records for its cache.

    Args:
        fn: the hook (``SaveHooks.pack`` or ``SaveHooks.unpack``).
        target: a module-level function doing the same for the hooks installed on the thread.
    """

    def __init__(self, fn: Callable[[Any], Any], target: Callable[[Any], Any]) -> None:
        graph = torch.fx.Graph()
        graph.output(graph.call_function(target, (graph.placeholder("x"),)))
        super().__init__(nn.Module(), graph)
        self.fn = fn
        # GraphModule gives each instance a class of its own, whose __call__ runs the graph.
        # A bound method is no descriptor: calling the module calls ``fn`` with no frame or
        # binding in between (``made_by`` in origins.py counts the frames to its caller).
        type(self).__call__ = fn
        never_compiled(fn)


# NOTE [Hooks dynamo never compiles]
# Autograd calls a saved-tensor hook from C++, and while a compiled function runs the code around
# a graph break (a ``print``, a data-dependent branch) eagerly, dynamo's frame callback is still
# set: it would compile the hook's own frame as if it were user code, and then the eager save
# path it reaches (the ledger's byte counts of a tensor with symbolic sizes) raises during
# tracing, so the model's step fails. A hook's frame and every frame it calls are therefore
# marked to be skipped (``FrameAction.SKIP`` for the frame and, recursively, its callees): the
# eager path runs as plain Python, as it does outside compiled code. Marking the code object
# adds no frame and no per-call cost, unlike a ``torch._dynamo.disable`` wrapper (a frame more,
# which ``origins.made_by`` would count). AOTAutograd's tracing of the hooks (NOTE [Compiled
# saves]) calls them with the callback unset, so it is unaffected.
def never_compiled(fn: Callable[..., Any]) -> None:
    """Mark ``fn``'s code (a function or bound method) so dynamo neither compiles it nor any
    frame it calls (NOTE [Hooks dynamo never compiles])."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # pragma: no cover - a torch without per-code frame strategies: unmarked
        return
    code = getattr(fn, "__func__", fn).__code__
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


class CompileSettings:
    """What GACT sets in ``torch.compile``'s configuration while any of its hooks are installed
    (``enter()`` at each install, ``exit()`` at each uninstall; settings the user chose are left
    alone): AOTAutograd hands compiled graphs' saved inputs and outputs to the hooks too (NOTE
    [Compiled saves]), and inductor's partitioner saves ReLU, softmax and log-softmax outputs
    and clamp inputs (NOTE [Saved outputs] in compiled_sites.py)."""

    _depth = 0
    _filtering = False  # whether the first enter() changed the filtering mode
    _save_pass: SaveOutputs | None = None  # the pass the first enter() installed

    @classmethod
    def enter(cls) -> None:
        config, inductor = torch._functorch.config, torch._inductor.config
        with _LOCK:
            if cls._depth == 0:
                mode = getattr(config, "saved_tensors_hooks_filtering_mode", None)
                cls._filtering = mode == "donated"
                if cls._filtering:
                    config.saved_tensors_hooks_filtering_mode = "no_static"
                if inductor.joint_custom_pre_pass is None:
                    cls._save_pass = inductor.joint_custom_pre_pass = SaveOutputs()
            cls._depth += 1

    @classmethod
    def exit(cls) -> None:
        config, inductor = torch._functorch.config, torch._inductor.config
        with _LOCK:
            cls._depth -= 1
            if cls._depth == 0:
                if cls._filtering and config.saved_tensors_hooks_filtering_mode == "no_static":
                    config.saved_tensors_hooks_filtering_mode = "donated"
                if cls._save_pass is not None and inductor.joint_custom_pre_pass is cls._save_pass:
                    inductor.joint_custom_pre_pass = None
                cls._filtering, cls._save_pass = False, None


# NOTE [Compile time]
# Dynamo calls its compilation callbacks at the start and the end of each outermost compilation:
# a frame's (trigger ``DYNAMO``, which traces GACT's hooks into the forward graph) and, at the
# first backward, that frame's backward, compiled lazily under the forward's compile id
# (``LAZY_BACKWARD``). A frame's compilation is a controller's when its hooks were traced into
# it (``SaveHooks.compiled_graphs`` grew meanwhile), and so is the backward compiled for it;
# other compilations while the hooks are installed (code that saves nothing under them) are
# not. ``stats()["compile_seconds"]`` reports their wall time. The training time that the
# adaptation budget is a share of leaves out what was compiled outside adaptations: a one-off
# compilation is no step's cost, and counted as one it let the first adaptations spend 5% of it
# and predicted each probe to cost as much as the first, compiling step. A compilation during
# an adaptation (a probe's sub-batch of a new shape) is that adaptation's cost and stays in it.
# ``torch._dynamo.reset()`` drops every callback, so the clock registers again at each root
# forward that finds it missing (a list lookup). Where torch has no such callbacks the clock
# stays at 0. AOTAutograd's own cache never serves a graph GACT's hooks are traced into (their
# subgraph calls a Python function it cannot hash), and must not: a hit would skip the tracing
# that registers the graph's sites. Inductor's cache still serves the generated code where the
# traced graph, site numbers included, is the same as in an earlier process.
class CompileClock:
    """Wall time of the compilations ``hooks`` were traced into (NOTE [Compile time]).

    Args:
        graphs: the forward graphs the hooks were traced into so far
            (``SaveHooks.compiled_graphs``).
    """

    def __init__(self, graphs: Collection[int]) -> None:
        self.seconds = 0.0
        self._graphs = graphs
        self._started: tuple[float, int] | None = None
        self._ids: set[str] = set()  # compile ids of the frames the hooks were traced into

    @staticmethod
    def _handler() -> Any:
        return getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)

    def start(self) -> None:
        """Time compilations from now on (again after ``torch._dynamo.reset()``)."""
        handler = self._handler()
        if handler is not None and self._on_start not in handler.start_callbacks:
            handler.register_start_callback(self._on_start)
            handler.register_end_callback(self._on_end)

    def stop(self) -> None:
        """Stop timing compilations."""
        handler = self._handler()
        if handler is not None and self._on_start in handler.start_callbacks:
            handler.remove_start_callback(self._on_start)
            handler.remove_end_callback(self._on_end)
        self._started = None

    def _on_start(self, args: Any) -> None:
        self._started = (time.perf_counter(), len(self._graphs))

    def _on_end(self, args: Any) -> None:
        if self._started is None:
            return
        (began, graphs), self._started = self._started, None
        trigger = args.callback_trigger.name
        if trigger == "DYNAMO" and len(self._graphs) > graphs:
            self._ids.add(args.compile_id)
        elif trigger != "LAZY_BACKWARD" or args.compile_id not in self._ids:
            return
        self.seconds += time.perf_counter() - began


def pack_on_thread(tensor: torch.Tensor) -> Any:
    """``SaveHooks.pack`` of the innermost GACT hooks installed on this thread."""
    from .hooks import installed_hooks

    return installed_hooks()[-1].pack(tensor)


def unpack_on_thread(packed: Any) -> torch.Tensor:
    """``SaveHooks.unpack`` of the innermost GACT hooks installed on this thread."""
    from .hooks import installed_hooks

    return installed_hooks()[-1].unpack(packed)
