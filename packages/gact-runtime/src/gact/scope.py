"""Stable names for saved tensors, and which model's forward is running."""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import weakref
from typing import Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from .decisions import DecisionMode

__all__ = ["OUTSIDE", "Frame", "ScopeTracker", "dtype_name"]

# NOTE [Save-site keys]
# A saved tensor is named by *where* it was saved, not by when: the qualified name of the
# innermost module running at that moment, the index of the save within that module's current
# call, and the tensor's dtype and rank, e.g. ``layer1.0.conv2#1:float32:4d``. Saves made outside
# every module of the model (a loss computed after ``model(x)``) are named under ``<outside>``,
# whose counter restarts whenever the model's root forward starts.
#
# Why: the original GACT numbered saves in forward order at step 0, which shifts as soon as a
# layer is skipped (dynamic control flow), a model is called twice before one backward
# (gradient accumulation), a region is recomputed (checkpointing) or a backward is skipped.
# Module-relative indices are unaffected by all of these: a skipped layer only removes its own
# keys, and a second forward reproduces the same keys. The shape is left out on purpose, so a
# smaller last batch keeps its bits; dtype and rank are in, so a save site whose tensor changes
# kind gets a key of its own rather than another tensor's bits.

OUTSIDE = "<outside>"

# Ticks order the entries into models across trackers, so that with nested controlled models the
# innermost one running owns a save (see NOTE [Owners] in hooks.py).
_ticks = itertools.count(1)


# NOTE [Compiled forwards]
# A compiled forward runs without ``DecisionMode``: the saves of its compiled graphs are traced
# into them with decisions read off the compiled backward (NOTE [Compiled saves] in
# compiled.py), while tensors saved by eager code between its graphs (at graph breaks) are kept
# as they are, since no ``DecisionMode`` saw the calls that saved them. The model's scope is
# entered where dynamo does not trace:
# - Given the module ``torch.compile(model)`` returned, the tracker hooks that module alone: its
#   hooks run before dynamo's frame starts, and the model itself has none. Hooks on the model's
#   root, wrapped in ``torch._dynamo.disable``, would run inside the compiled frame for a
#   torch.nn container (dynamo inlines ``nn.Sequential``'s call), breaking the graph before and
#   after the forward; a torch that cannot resume a graph break inside an inlined call (2.11)
#   then runs the whole forward eagerly, and nothing was compressed. With a model class of the
#   user's own, ``torch.compile`` runs the model's hooks outside its frames anyway. A call of
#   the uncompiled model itself is then outside the controlled forward: its saves are kept.
# - Otherwise a global forward pre-hook notices a call of any module whose ``_orig_mod`` is
#   the model (``torch.compile(model)`` made after the hooks were installed, or without the
#   controller seeing it) and enters the scope there, before dynamo's frame, setting
#   ``_in_compiled_module``; the model's root hooks then return at once, a flag read that
#   dynamo traces and guards on, with no graph break. Before, the compiled forward of an
#   ``nn.Sequential`` compiled after ``install_hook()`` ran eagerly on torch 2.11, every save
#   kept.
# - A compiled module seen called with gradients on is remembered (``compiled_module``, through
#   a weak reference) and the next ``attach`` hooks it alone, as if it had been given: hooks
#   registered anew on every module at each install fail dynamo's guards, so a model compiled
#   after ``install_hook()`` (the Trainer's ``torch_compile=True`` under a callback that
#   installs around every step) recompiled at each cycle, and past dynamo's recompile limit (8)
#   ran eagerly with every save kept. A module compiled for evaluation (called under
#   ``no_grad``) is not remembered, so the eager model's training stays in the controlled
#   forward; a step that saves tensors without calling it (the uncompiled model trained: its
#   saves were kept) forgets it, with a warning, and the next install hooks every module again.
# - Where no compiled module wraps the model (``model.compile()``, which compiles
#   ``_call_impl`` and so runs the root's hooks in a frame dynamo skips, or a compiled function
#   that calls the model), the root's hooks enter through a ``torch._dynamo.disable``-d call,
#   which notices that dynamo is running the forward (``_called_by_dynamo``). Inside a traced
#   frame that breaks the graph: torch 2.13 resumes after it, 2.11 runs the forward eagerly
#   (``Controller._on_compiled`` warns and says to pass the compiled module instead).
# The hooks of submodules do nothing while dynamo traces, so they leave no side effects in the
# graph. A model known to be compiled when the hooks are installed gets no submodule hooks: they
# would do nothing, and dynamo guards on them, so registering them anew at every
# ``install_hook()`` would recompile the model each time (the root's or the compiled module's
# hooks run outside the compiled frames). Its eager saves at graph breaks are then all named
# under ``<root>``.


def _nothing(*args: object) -> None:
    """What a hook of GACT's on a module becomes in a pickled model (see ``_ModelHook``)."""


def _revived() -> Callable[..., None]:
    return _nothing


class _ModelHook(functools.partial):
    """A forward hook GACT registers on a module of the user's model. ``torch.save(model)``
    while the hooks are installed pickles it as a hook that does nothing: the controller that
    registered it is not part of the model; so does a ``copy.deepcopy`` of the model (an EMA
    copy), which copies through pickling's protocol. Its own closures, local functions, could
    not be pickled, so saving the model failed. A ``functools.partial`` calls its function
    from C (about 30 ns more per call) and dynamo traces it as the function."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return (_revived, ())


def _eager(hook: Callable[..., None]) -> Callable[..., None]:
    import torch._dynamo

    return torch._dynamo.disable(hook)


def _called_by_dynamo() -> bool:
    """Whether a frame of dynamo's compiled-call wrapper is on the Python stack (the frames of
    ``torch._dynamo.disable``'s own wrapper, through which the root hooks run, do not count)."""
    from torch._dynamo.eval_frame import DisableContext

    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_DYNAMO_WRAPPER) and not isinstance(
            frame.f_locals.get("self"), DisableContext
        ):
            return True
        frame = frame.f_back
    return False


_DYNAMO_WRAPPER = os.path.join("_dynamo", "eval_frame.py")


class Frame:
    """One running call of a module of the model (the bottom frame: outside every module).

    Attributes:
        module: the module (``None`` for the bottom frame).
        name: its qualified name, which names its saves (NOTE [Save-site keys]).
        args: the positional arguments of the call, held while it runs.
        count: saves made in the call so far.
        call: what the save hooks keep for the call (NOTE [Recomputed activations] in
            recomputed.py), ``None`` until its first save.
    """

    __slots__ = ("args", "call", "count", "module", "name")

    def __init__(self, module: nn.Module | None, name: str, args: tuple[object, ...] = ()) -> None:
        self.module = module
        self.name = name
        self.args = args
        self.count = 0
        self.call: object = None

    def next_key(self, tensor: torch.Tensor) -> str:
        """The key of the call's next save, ``tensor`` (advances its counter)."""
        index = self.count
        self.count += 1
        return f"{self.name}#{index}:{dtype_name(tensor.dtype)}:{tensor.dim()}d"


class _ModeScope:
    """One ``DecisionMode`` per thread, pushed while any controlled forward runs on it."""

    _local = threading.local()

    @classmethod
    def enter(cls) -> None:
        depth = getattr(cls._local, "depth", 0)
        if depth == 0:
            mode: TorchFunctionMode = DecisionMode()
            mode.__enter__()
            cls._local.mode = mode
        cls._local.depth = depth + 1

    @classmethod
    def leave(cls) -> None:
        depth = getattr(cls._local, "depth", 0) - 1
        if depth < 0:
            return
        cls._local.depth = depth
        if depth == 0:
            mode, cls._local.mode = cls._local.mode, None
            mode.__exit__(None, None, None)


class ScopeTracker:
    """Tracks the innermost running module of ``model`` and names saves within it.

    Args:
        model: the model whose modules are tracked (submodules included).
        on_root_forward: called whenever the model's own forward starts.
        on_compiled_return: called with the output whenever a compiled forward of the model
            returns (see NOTE [Compiled forwards]).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4))
        >>> tracker = ScopeTracker(model, on_root_forward=lambda: None)
        >>> tracker.attach()
        >>> _ = model[0].register_forward_pre_hook(  # runs after the tracker entered model[0]
        ...     lambda m, args: print(tracker.next_key(args[0])))
        >>> _ = model(torch.randn(2, 4))
        0#0:float32:2d
        >>> tracker.detach()
    """

    def __init__(
        self,
        model: nn.Module,
        on_root_forward: Callable[[], None],
        on_compiled_return: Callable[[object], None] = lambda output: None,
        compiled_module: nn.Module | None = None,
    ) -> None:
        self._model = model
        self._on_root_forward = on_root_forward
        self._on_compiled_return = on_compiled_return
        self._local = threading.local()
        self._handles: list[RemovableHandle] = []
        self._labels: dict[int, str] = {}  # id(submodule) -> its name (NOTE below)
        self._generation = 0  # bumped at every root forward
        # a call of the module torch.compile(model) returned is running (NOTE [Compiled forwards])
        self._in_compiled_module = False
        # the module torch.compile(model) returned, given or seen trained through
        self._compiled_ref = None if compiled_module is None else weakref.ref(compiled_module)
        self._compiled_given = compiled_module is not None
        self._boundary_generation = 0  # the generation at the last step boundary
        # the model's compiled code runs eagerly, to be measured (NOTE [Measured compiled saves]
        # in measured_compiled.py): its forwards are eager code's
        self.forced_eager = False

    def _stack(self) -> list[Frame]:
        local = self._local
        stack = getattr(local, "stack", None)
        if stack is None:
            stack = local.stack = [Frame(None, OUTSIDE)]
            local.generation = self._generation
            local.entered = 0
            local.compiled = False
        elif local.generation != self._generation:
            # Another thread (e.g. an autograd worker recomputing a checkpointed region) saw a
            # root forward start since: its <outside> counter restarts like the main thread's.
            stack[0].count = 0
            local.generation = self._generation
        return stack

    # NOTE [One hook for every module]
    # Dynamo guards on the hooks of each module it traces: with a hook closure per module, or
    # with per-module ``always_call`` hooks (whose registry holds each handle's id), each of N
    # blocks compiled alone (``block.compile()``) failed the guards of the others and compiled
    # a graph of its own, and past dynamo's recompile limit (8) the rest ran uncompiled. So
    # every submodule gets the same pre-hook, which looks its label up, and one global forward
    # hook (``always_call``, so a forward that raises still pops its frame and, for a module
    # called alone, its ``DecisionMode``) serves them all, ignoring modules of other models.
    # The blocks then share one graph, as they do without GACT. The root keeps hooks of its
    # own (``_eager``: see NOTE [Compiled forwards]). PyTorch runs global forward hooks before
    # a module's own, so what a user's forward hook on a submodule saves is named in the
    # parent's scope (deterministically, as every key must be).
    def attach(self, *, compiled: nn.Module | None = None) -> None:
        """Register forward pre/post hooks on every module of the model, or, for a model known
        to be compiled, on the compiled module or the model's root alone (NOTE [Compiled
        forwards]).

        Args:
            compiled: the module ``torch.compile(model)`` returned, whose hooks then enter the
                model's scope, or the model itself after ``model.compile()``; ``None`` for a
                model not known to be compiled.
        """
        if self._handles:
            return
        if compiled is not None and compiled is not self._model:
            enter_compiled = _ModelHook(self._compiled_module_enter)
            leave_compiled = _ModelHook(self._compiled_module_leave)
            self._handles.append(compiled.register_forward_pre_hook(enter_compiled))
            self._handles.append(compiled.register_forward_hook(leave_compiled, always_call=True))
            return
        enter, leave = self._module_hooks()
        enter = _ModelHook(enter)
        for name, module in self._model.named_modules():
            if not name:
                enter_root = _ModelHook(self._root_enter())
                leave_root = _ModelHook(self._root_leave())
                self._handles.append(module.register_forward_pre_hook(enter_root))
                self._handles.append(module.register_forward_hook(leave_root, always_call=True))
            elif compiled is not None:
                break
            else:
                self._labels[id(module)] = name
                self._handles.append(module.register_forward_pre_hook(enter))
        if compiled is None:
            self._handles.append(register_module_forward_pre_hook(self._global_enter))
            self._handles.append(register_module_forward_hook(leave, always_call=True))

    @property
    def compiled_module(self) -> nn.Module | None:
        """The module ``torch.compile(model)`` returned, given or seen trained through (NOTE
        [Compiled forwards]), while it lives; ``None`` if none."""
        return None if self._compiled_ref is None else self._compiled_ref()

    def end_step(self, saved: bool) -> bool:
        """At a step boundary: forget a compiled module seen trained through if this step
        saved tensors without calling the model through it (the uncompiled model was trained,
        its saves kept: NOTE [Compiled forwards]), so the next ``attach`` hooks every module
        again. Returns whether it forgot one."""
        idle = self._generation == self._boundary_generation
        self._boundary_generation = self._generation
        if saved and idle and self._compiled_ref is not None and not self._compiled_given:
            self._compiled_ref = None
            return True
        return False

    def detach(self) -> None:
        """Remove the hooks; the tracker can be attached again later."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._labels.clear()
        self._local = threading.local()
        self._in_compiled_module = False

    def _push(
        self, module: nn.Module, label: str, args: object = (), compiled: bool = False
    ) -> None:
        stack = self._stack()
        compiled = compiled and not self.forced_eager
        if len(stack) == 1:  # entering the model (its root, or a submodule called alone)
            self._local.entered = next(_ticks)
            self._local.compiled = compiled
            if not compiled:
                _ModeScope.enter()
        stack.append(Frame(module, label, args if isinstance(args, tuple) else ()))

    def _pop(self, module: nn.Module) -> None:
        stack = self._stack()
        # Pop up to and including this module's frame (a frame left behind by an exception in
        # a hook of a submodule is discarded with it).
        for depth in range(len(stack) - 1, 0, -1):
            if stack[depth].module is module:
                del stack[depth:]
                if depth == 1 and not self._local.compiled:
                    _ModeScope.leave()
                return

    def _module_hooks(self):
        labels = self._labels

        def enter(module: nn.Module, args: object) -> None:
            if torch.compiler.is_compiling():
                return  # a submodule traced by dynamo (see NOTE [Compiled forwards])
            label = labels.get(id(module))
            if label is not None:  # (none: a shallow copy of a submodule, sharing the hook)
                self._push(module, label, args)

        def leave(module: nn.Module, args: object, output: object) -> None:
            if torch.compiler.is_compiling():
                return  # traced by dynamo
            if id(module) in labels:
                self._pop(module)
            elif self._in_compiled_module and module._modules.get("_orig_mod") is self._model:
                self._compiled_module_leave(module, args, output)

        return enter, leave

    def _global_enter(self, module: nn.Module, args: object) -> None:
        """Global pre-hook: the module ``torch.compile(model)`` returned is called, outside
        dynamo's frames (NOTE [Compiled forwards])."""
        if module._modules.get("_orig_mod") is self._model and not torch.compiler.is_compiling():
            if torch.is_grad_enabled():  # trained through: hook it alone from the next install
                self._compiled_ref = weakref.ref(module)
            self._compiled_module_enter(module, args)

    def _enter_root(self, compiled: bool) -> None:
        self._generation += 1
        self._on_root_forward()
        self._push(self._model, "<root>", compiled=compiled)

    def _leave_root(self, output: object) -> None:
        compiled = self.compiled()
        self._pop(self._model)
        if compiled:
            self._on_compiled_return(output)

    def _root_enter(self):
        eager = _eager(lambda module, args: self._enter_root(compiled=_called_by_dynamo()))

        def enter_root(module: nn.Module, args: object) -> None:
            if self._in_compiled_module:  # traced by dynamo: a guard on the flag, no graph break
                return
            if module is not self._model:  # a shallow copy of the model shares the hook
                return
            eager(module, args)

        return enter_root

    def _root_leave(self):
        eager = _eager(lambda module, args, output: self._leave_root(output))

        def leave_root(module: nn.Module, args: object, output: object) -> None:
            if self._in_compiled_module or module is not self._model:
                return
            eager(module, args, output)

        return leave_root

    def _compiled_module_enter(self, module: nn.Module, args: object) -> None:
        """A call of the module ``torch.compile(model)`` returned starts (its own hook, or the
        global one): the model's scope is entered outside dynamo's frames."""
        self._in_compiled_module = True
        self._enter_root(compiled=True)

    def _compiled_module_leave(self, module: nn.Module, args: object, output: object) -> None:
        self._in_compiled_module = False
        self._leave_root(output)

    def compiled(self) -> bool:
        """Whether the running forward of the model is a compiled one (on this thread)."""
        return len(self._stack()) > 1 and self._local.compiled

    @property
    def generation(self) -> int:
        """Number of root forwards so far (identifies the current forward)."""
        return self._generation

    def entered(self) -> int:
        """On this thread: when the running forward of the model started (a tick that orders
        entries across trackers), or 0 when no module of the model is running."""
        return self._local.entered if len(self._stack()) > 1 else 0

    def running(self) -> Frame:
        """The frame of the innermost running module of the model on this thread (the bottom
        frame, named ``<outside>``, when none runs)."""
        return self._stack()[-1]

    def next_key(self, tensor: torch.Tensor) -> str:
        """The key of the next save in the current scope (advances the scope's counter)."""
        return self._stack()[-1].next_key(tensor)


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``, as save-site keys name dtypes (on every save)."""
    return str(dtype).removeprefix("torch.")
