"""Argument validation shared by the public functions and containers; errors name the argument."""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch

from ._backend import require_device

__all__ = [
    "MAX_GROUP_SIZE",
    "check_bits",
    "check_buffer",
    "check_channel_dim",
    "check_dtype",
    "check_group_size",
    "check_seed",
    "check_tensor",
    "check_zero_exact",
    "integer",
]

#: Largest accepted group size. Group sizes are multiples of 8 in [8, MAX_GROUP_SIZE]: a chunk of
#: 8 codes always fills whole bytes (NOTE [storage and RNG invariants] in ``csrc/common.h``).
MAX_GROUP_SIZE = 1 << 16


def _names(dtypes: Collection[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(x: object, name: str, dtypes: Collection[torch.dtype]) -> torch.Tensor:
    """Returns ``x`` if it is a dense tensor of an accepted dtype on a supported device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout is not torch.strided:
        raise ValueError(
            f"{name}: layout {x.layout} is not supported (sparse and other non-strided layouts "
            f"are not); pass a dense tensor, e.g. {name}.to_dense()"
        )
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {x.dtype} is not supported; accepted: {_names(dtypes)}")
    device = x.device
    if device.type != "cpu":
        require_device(device, name)
    return x


def integer(value: object, name: str) -> int:
    """Returns ``value`` as an int (anything with ``__index__`` except bool)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def check_bits(bits: object, name: str = "bits") -> int:
    """Returns ``bits`` as an int in 1..8."""
    if type(bits) is int and 1 <= bits <= 8:  # the common case first: every save checks
        return bits
    bits = integer(bits, name)
    if not 1 <= bits <= 8:
        raise ValueError(f"{name} must be one of 1, 2, 3, 4, 5, 6, 7, 8; got {bits}")
    return bits


def check_zero_exact(zero_exact: object, bits: int, name: str = "zero_exact") -> bool:
    """Returns ``zero_exact`` if it is a bool, and allowed with ``bits`` (True needs bits >= 2)."""
    if not isinstance(zero_exact, bool):
        raise TypeError(f"{name} must be a bool, got {type(zero_exact).__name__}")
    if zero_exact and bits < 2:
        raise ValueError(
            f"{name}=True needs bits >= 2; got bits={bits}: with 1 bit the grid would have a "
            f"single positive level (the smallest normal number), so positive values could not "
            f"be rounded unbiasedly"
        )
    return zero_exact


def check_channel_dim(channel_dim: object, ndim: int, name: str = "channel_dim") -> int:
    """Returns ``channel_dim`` as a dimension index in [0, ndim) (negative counts from the end)."""
    channel_dim = integer(channel_dim, name)
    if not -ndim <= channel_dim < ndim:
        raise ValueError(
            f"{name} must name a dimension of the {ndim}-dimensional tensor (between {-ndim} "
            f"and {ndim - 1}), got {channel_dim}; use None to group in memory order"
        )
    return channel_dim % ndim


def check_group_size(group_size: object, name: str = "group_size") -> int:
    """Returns ``group_size`` as an int: a multiple of 8 in [8, 65536]."""
    if type(group_size) is not int:
        group_size = integer(group_size, name)
    if group_size <= 0 or group_size % 8 or group_size > MAX_GROUP_SIZE:
        raise ValueError(
            f"{name} must be a multiple of 8 between 8 and {MAX_GROUP_SIZE} "
            f"(e.g. 64, 128, 256, 512); got {group_size}"
        )
    return group_size


def check_seed(seed: object, name: str = "seed") -> int:
    """Returns ``seed`` as an int in [0, 2**64)."""
    if type(seed) is int and 0 <= seed < 1 << 64:
        return seed
    seed = integer(seed, name)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"{name} must be an int in [0, 2**64); got {seed}")
    return seed


def check_dtype(dtype: object, accepted: Collection[torch.dtype], name: str) -> None:
    """Raises unless ``dtype`` is one of the ``accepted`` dtypes."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in accepted:
        raise ValueError(f"{name} must be one of {_names(accepted)}; got {dtype}")


def check_buffer(
    t: object, name: str, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> None:
    """Raises unless ``t`` is a contiguous, strided tensor of ``dtype``, ``shape`` and ``device``.

    Used on the fields of the compressed containers before their addresses reach the kernels.
    """
    if (
        isinstance(t, torch.Tensor)
        and t.dtype is dtype
        and t.layout is torch.strided
        and t.shape == shape
        and t.device == device
        and t.is_contiguous()
    ):
        return  # the common case, in one expression: this runs on every restore
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense {dtype} tensor; got a {t.layout} {t.dtype} one")
    if t.shape != shape:
        raise ValueError(
            f"{name} must have shape {tuple(shape)} to match the container's metadata; got "
            f"{tuple(t.shape)} (was it built by hand, or resized in place?)"
        )
    if t.device != device:
        raise ValueError(
            f"{name} is on {t.device} but the container's other buffers are on {device}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; build it with .contiguous()")
