"""Argument validation shared by the public functions; every error names its argument."""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch

from ._backend import require_device

__all__ = ["MAX_GROUP_SIZE", "check_bits", "check_group_size", "check_seed", "check_tensor"]

#: Largest accepted group size; group sizes must be multiples of 8 (see NOTE in ``csrc/common.h``).
MAX_GROUP_SIZE = 1 << 16


def _names(dtypes: Collection[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(x: object, name: str, dtypes: Collection[torch.dtype]) -> torch.Tensor:
    """Returns ``x`` if it is a tensor of an accepted dtype on a supported device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {x.dtype} is not supported; accepted: {_names(dtypes)}")
    require_device(x.device, name)
    return x


def _integer(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def check_bits(bits: object) -> int:
    """Returns ``bits`` as an int in 1..8."""
    bits = _integer(bits, "bits")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be one of 1, 2, 3, 4, 5, 6, 7, 8; got {bits}")
    return bits


def check_group_size(group_size: object) -> int:
    """Returns ``group_size`` as an int: a multiple of 8 in [8, 65536]."""
    group_size = _integer(group_size, "group_size")
    if group_size <= 0 or group_size % 8 or group_size > MAX_GROUP_SIZE:
        raise ValueError(
            f"group_size must be a multiple of 8 between 8 and {MAX_GROUP_SIZE} "
            f"(e.g. 64, 128, 256, 512); got {group_size}"
        )
    return group_size


def check_seed(seed: object) -> int:
    """Returns ``seed`` as an int in [0, 2**64)."""
    seed = _integer(seed, "seed")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64); got {seed}")
    return seed
