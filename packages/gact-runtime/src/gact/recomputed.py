"""Smooth activations written as several operations: recomputed in the backward from their
saved input instead of storing every intermediate."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .errors import GactError

__all__ = ["RECOMPUTED_ACTIVATIONS", "ActivationCall", "recomputable"]

# NOTE [Recomputed activations]
# Some activations are written as several elementwise operations rather than one call:
# transformers' ``NewGELUActivation`` (``gelu_new``: GPT-2, GPT-J, CodeGen, Phi),
# ``FastGELUActivation``, ``AccurateGELUActivation`` and ``QuickGELUActivation`` (CLIP). Autograd
# saves every operation's operands: 3-7 tensors of the activation's size per call where ``F.gelu``
# saves one. On transformers' GPT-2 4x128 without dropout they are 42% of the saved bytes (229 MiB
# against 133 MiB with ``gelu_pytorch_tanh``, the same function fused). Each is a deterministic
# function of the activation's input, and a smooth one (no decision that a rounded input could
# flip: NOTE [Exact decisions] in decisions.py). So within a call of one of these modules, at a
# level that compresses, GACT stores the input as any save (it is one of the call's saves) and
# every other save as a handle (``SavedRecomputed`` in saved.py): its position among the call's
# saves, its shape, dtype and strides, and a version witness, no data. The first handle unpacked
# re-runs the module's forward on the restored input, under the autocast state of the original
# call and with identity hooks innermost, collecting what it saves; each handle takes its own, so
# a call is recomputed once per backward (again in a second one, ``retain_graph=True``). The
# recomputed saves must match the originals in number, shape, dtype and strides, else the unpack
# raises (a module whose forward changed between forward and backward): a handle never returns
# another tensor. With the input kept as it is, gradients are bit-identical to PyTorch's;
# quantized, every intermediate is the exact value at the one rounded input instead of being
# rounded on its own. That trades error for bytes: at equal widths the gradient errs 1.2-1.5x as
# much as with every intermediate rounded (an MLP with only the activation's saves quantized), in
# a half (QuickGELU) to a seventh (FastGELU) of the bytes; the 4-bit input alone errs 3-4x less
# than every intermediate at 2 bits, in half the bytes (``tests/test_recomputed.py``). A save that
# a decision rule publishes a spec for (none does in these modules today), or that would be kept
# as it is, takes the usual path. Only the classes listed are recomputed, matched by qualified
# name so that transformers need not be installed: a module with a decision
# (``ReLUSquaredActivation``) would not be exact, one with parameters or randomness not
# deterministic. ``GactConfig(recompute_activations=False)`` stores every save.
RECOMPUTED_ACTIVATIONS: frozenset[tuple[str, str]] = frozenset(
    ("transformers.activations", name)
    for name in (
        "NewGELUActivation",
        "FastGELUActivation",
        "AccurateGELUActivation",
        "QuickGELUActivation",
    )
)

_recomputable: dict[type, bool] = {}


def recomputable(module: object) -> bool:
    """Whether ``module``'s calls are recomputed (NOTE [Recomputed activations])."""
    cls = type(module)
    known = _recomputable.get(cls)
    if known is None:
        known = _recomputable[cls] = (cls.__module__, cls.__qualname__) in RECOMPUTED_ACTIVATIONS
    return known


class ActivationCall:
    """One call of a recomputed activation (NOTE [Recomputed activations]).

    Args:
        module: the activation module.
        device_type: the device type of its input, whose autocast state is recorded.
    """

    __slots__ = ("_taken", "autocast", "count", "device_type", "handles", "input", "module")

    def __init__(self, module: nn.Module, device_type: str) -> None:
        self.module = module
        self.device_type = device_type
        self.autocast = (
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        )
        self.count = 0  # saves of the call so far; a handle's index is its position among them
        self.handles: set[int] = set()  # the positions of the saves held as handles
        self.input: object = None  # the Saved of the call's input, once it is saved
        # the recomputed saves, each with the number of unpacks still to take it in this
        # backward (None before the first)
        self._taken: list[list[object]] | None = None

    @classmethod
    def of(cls, module: nn.Module, args: tuple[object, ...]) -> ActivationCall | None:
        """The call's state if ``module`` is recomputed and was called on a floating-point
        tensor that requires grad, else ``None``."""
        if not recomputable(module) or not args:
            return None
        x = args[0]
        if type(x) is not torch.Tensor or not x.requires_grad or not x.is_floating_point():
            return None
        return cls(module, x.device.type)

    def saw_input(self, saved: object) -> None:
        """The call's input was saved as ``saved`` (the first save of it counts)."""
        if self.input is None:
            self.input = saved

    def take(
        self, index: int, uses: int, like: tuple[torch.Size, torch.dtype, tuple[int, ...]]
    ) -> torch.Tensor:
        """The recomputed save at ``index`` (recomputing the call if no unpack still holds it
        for this backward); ``uses``: how many unpacks read it per backward; ``like``: the
        shape, dtype and strides of the original."""
        if self._taken is None or self._taken[index][0] is None:
            saves = self._recompute()  # what no handle takes goes at once
            self._taken = [[t if i in self.handles else None, None] for i, t in enumerate(saves)]
        entry = self._taken[index]
        if entry[1] is None:  # the first of its unpacks in this backward
            entry[1] = uses
        tensor = entry[0]
        assert isinstance(tensor, torch.Tensor)
        got = (tensor.shape, tensor.dtype, tensor.stride())
        if got != like:
            raise self._mismatch(f"its save {index} came back as {got}, not {like}")
        entry[1] = uses = int(entry[1]) - 1  # type: ignore[call-overload]
        if uses <= 0:
            entry[0] = None  # the last unpack of this backward: let it go with its node
        return tensor

    def _recompute(self) -> list[torch.Tensor]:
        restore = getattr(self.input, "unpack", None)
        if restore is None:
            raise GactError(
                f"GACT recomputes the intermediates of {type(self.module).__name__} from its "
                "input, but the call never saved its input (a forward pre-hook replaced it?); "
                "pass GactConfig(recompute_activations=False) to store them instead, and "
                "please report the model to GACT"
            )
        x = restore().detach().requires_grad_()
        saves: list[torch.Tensor] = []

        def keep(tensor: torch.Tensor) -> torch.Tensor:
            # detached: a saved output holding its own grad_fn would be a cycle through C++,
            # which Python's collector never frees (the recomputed graph leaked every step)
            saves.append(tensor.detach())
            return saves[-1]

        enabled, dtype, cache = self.autocast
        autocast = (
            torch.autocast(self.device_type, dtype=dtype, enabled=True, cache_enabled=cache)
            if enabled
            else contextlib.nullcontext()
        )
        with torch.enable_grad(), autocast:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                self.module.forward(x)
        if len(saves) != self.count:
            raise self._mismatch(f"it saved {len(saves)} tensors, not {self.count}")
        return saves

    def _mismatch(self, what: str) -> GactError:
        return GactError(
            f"GACT recomputed a call of {type(self.module).__name__} in the backward, but "
            f"{what} as in the forward: its forward must be a deterministic function of its "
            "input (NOTE [Recomputed activations]); pass "
            "GactConfig(recompute_activations=False) to store its intermediates instead"
        )
