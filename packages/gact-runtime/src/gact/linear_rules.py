"""The rules of calls that read a save linearly into a parameter's gradient (``F.linear``,
matrix products, convolutions), which a sensitivity meter measures (NOTE [Measured
sensitivities] in measured.py), and the calls whose backward multiplies one saved argument by
another (``PRODUCTS``, NOTE [Products of a shared save] in live.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .decision_spec import DecisionSpec, LinearUse, Rule, argument

__all__ = ["PRODUCTS", "measuring", "meter_rules", "set_measuring"]

_meters: weakref.WeakSet[object] = weakref.WeakSet()  # running sensitivity meters


def measuring() -> bool:
    """Whether a sensitivity meter runs: calls that read a save linearly into a parameter's
    gradient then publish a ``LinearUse`` (NOTE [Measured sensitivities] in measured.py);
    otherwise they cost nothing here."""
    return bool(_meters)


def set_measuring(meter: object, on: bool) -> None:
    """``meter`` starts (``on``) or stops running; a meter nobody holds any more stops."""
    if on:
        _meters.add(meter)
    else:
        _meters.discard(meter)


def _parameter(value: Any) -> bool:
    """A leaf tensor whose gradient autograd accumulates (a parameter, cast inside the call
    under autocast)."""
    return isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is None


def _product(
    x_at: tuple[int, str],
    weight_at: tuple[int, str],
    *,
    matrix: bool,
    bias_at: tuple[int, str] | None = None,
) -> Rule:
    """Rule of a call computing ``x W`` (rows of ``x``) with a parameter ``W`` at ``weight_at``
    (position, keyword), a matrix if ``matrix``, plus the bias at ``bias_at`` if any:
    ``F.linear``, ``addmm``, ``matmul``, ``mm``."""

    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        weight = argument(args, kwargs, *weight_at, None)
        if not _parameter(weight) or (matrix and weight.dim() != 2):
            return None
        x = argument(args, kwargs, *x_at, None)
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or not x.numel():
            return None
        bias = bias_at is not None and _parameter(argument(args, kwargs, *bias_at, None))
        return DecisionSpec(linear=LinearUse(x.numel(), None, bias))

    return rule


def _conv(dims: int) -> Rule:
    def rule(args: Sequence[Any], kwargs: dict[str, Any]) -> DecisionSpec | None:
        x, weight = (
            argument(args, kwargs, 0, "input", None),
            argument(args, kwargs, 1, "weight", None),
        )
        if not (_parameter(weight) and weight.dim() == dims + 2):
            return None
        if not isinstance(x, torch.Tensor) or x.dim() != dims + 2 or not x.numel():
            return None  # unbatched inputs: not measured

        def per_dim(value: Any) -> tuple[int, ...]:
            return tuple(value) if isinstance(value, (tuple, list)) else (int(value),) * dims

        kernel = tuple(weight.shape[2:])
        stride = per_dim(argument(args, kwargs, 3, "stride", 1))
        dilation = per_dim(argument(args, kwargs, 5, "dilation", 1))
        padding = argument(args, kwargs, 4, "padding", 0)
        if padding == "valid":
            padding = 0
        elif padding == "same":  # symmetric only when every dilated kernel is odd-sized
            total = [d * (k - 1) for d, k in zip(dilation, kernel)]
            if any(t % 2 for t in total):
                return None
            padding = tuple(t // 2 for t in total)
        groups = int(argument(args, kwargs, 6, "groups", 1))
        return DecisionSpec(
            linear=LinearUse(x.numel(), (stride, per_dim(padding), dilation, groups, kernel))
        )

    return rule


def meter_rules() -> dict[Callable[..., Any], Rule]:
    """The rules of calls that read a save linearly into a parameter's gradient: they matter
    only while a sensitivity meter runs (NOTE [Measured sensitivities] in measured.py)."""
    T = torch.Tensor
    matmul = _product((0, "input"), (1, "other"), matrix=True)
    return {
        F.linear: _product((0, "input"), (1, "weight"), matrix=False, bias_at=(2, "bias")),
        **dict.fromkeys(
            (torch.addmm, T.addmm),
            _product((1, "mat1"), (2, "mat2"), matrix=True, bias_at=(0, "input")),
        ),
        **dict.fromkeys((torch.matmul, T.matmul, T.__matmul__), matmul),
        **dict.fromkeys((torch.mm, T.mm), _product((0, "input"), (1, "mat2"), matrix=True)),
        F.conv1d: _conv(1),
        F.conv2d: _conv(2),
        F.conv3d: _conv(3),
    }


# Calls whose backward multiplies the gradient by one saved argument to give another argument's
# gradient (divisions too: ``a / b`` gives ``b`` the gradient ``-g a / b^2``): ``DecisionMode``
# publishes their arguments (NOTE [Products of a shared save] in live.py).
def _products() -> frozenset[Callable[..., Any]]:
    T = torch.Tensor
    funcs = [
        torch.mul, T.mul, T.mul_, T.__mul__, T.__rmul__, T.__imul__, torch.multiply, T.multiply,
        T.multiply_, torch.div, T.div, T.div_, T.__truediv__, T.__rtruediv__, T.__itruediv__,
        torch.divide, T.divide, T.divide_, torch.true_divide, T.true_divide, torch.matmul,
        T.matmul, T.__matmul__, T.__rmatmul__, torch.mm, T.mm, torch.bmm, T.bmm, torch.mv, T.mv,
        torch.dot, T.dot, torch.vdot, torch.inner, torch.outer, T.outer, torch.ger, torch.kron,
        torch.einsum, torch.tensordot, torch.addmm, T.addmm, T.addmm_, torch.addmv, T.addmv,
        torch.addr, T.addr, torch.baddbmm, T.baddbmm, T.baddbmm_, torch.addbmm, torch.addcmul,
        T.addcmul, T.addcmul_, torch.addcdiv, T.addcdiv, T.addcdiv_, torch.linalg.multi_dot,
        torch.linalg.vecdot, torch.cross, torch.linalg.cross, torch.linalg.matmul,
        torch.chain_matmul, torch.lerp, T.lerp, T.lerp_, F.linear, F.bilinear, F.conv1d,
        F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    ]  # fmt: skip
    return frozenset(f for f in funcs if f is not None)


PRODUCTS = _products()
