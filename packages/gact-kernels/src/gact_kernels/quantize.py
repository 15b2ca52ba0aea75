"""Per-group stochastic-rounding quantisation of float tensors to 1-8 bits."""

from __future__ import annotations

import dataclasses
import math

import torch

from ._backend import DTYPE_CODES, current_stream, launch
from ._checks import (
    check_bits,
    check_buffer,
    check_channel_dim,
    check_dtype,
    check_group_size,
    check_seed,
    check_tensor,
    check_zero_exact,
)
from ._compressed import Compressed
from ._layout import (
    channel_grouping,
    channel_runs,
    check_layout,
    empty_with_layout,
    flat_view,
    from_channel_runs,
    memory_order,
    padded_run,
    plane_group,
    restore_stride,
    to_channel_runs,
)
from .pending import PendingQuantize, element_index, flag_ring, lossless_groups

__all__ = ["FLOAT_DTYPES", "QuantizedTensor", "dequantize", "quantize", "quantize_async"]

#: Input dtypes accepted by :func:`quantize`.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The byte format and both random streams are defined once, in NOTE [storage and RNG
# invariants] in csrc/common.h; reference.py restates them in torch.


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class QuantizedTensor(Compressed):
    """A tensor compressed by :func:`quantize`; immutable, holds torch tensors on one device.

    Attributes:
        data: uint8, ceil(numel*bits/8) packed codes.
        lo: float32 per group, the group minimum (0 for lossless groups).
        scale: float32 per group, the step; NaN marks a group stored losslessly. In a group
            on the sign-exact grid (``zero_exact`` and ``lo`` is +0) it is that grid's step
            ``(max - tiny) / (2**bits - 2)``, or 0 if ``max <= tiny``.
        lossless_groups: int64 indices of the groups stored losslessly: those holding NaN/Inf,
            whose range overflows float32, or whose step would be subnormal (empty almost
            always).
        lossless_values: their raw elements, shape (len(lossless_groups), group_size), in
            ``dtype``; a partial last group repeats its final element.
        bits: code width, 1..8.
        group_size: elements per group (consecutive in memory, or within one channel's run
            when ``channel_dim`` is set).
        seed: the seed of :func:`quantize`; :func:`dequantize` derives the stochastic rounding
            of float16/bfloat16 outputs from it.
        shape: shape of the original tensor.
        stride: strides of the restored tensor (the original's when it was dense).
        dtype: dtype of the original tensor.
        zero_exact: whether groups whose ``lo`` is +0 use the sign-exact grid (see
            :func:`quantize`); needs ``bits >= 2``.
        channel_dim: ``None`` for groups in memory order; else the dimension whose channels
            the groups never span: the codes then cover the channel-major block of padded runs
            of NOTE [channel groups] in _layout.py (``stored_numel`` elements).

    Example:
        >>> import torch, gact_kernels
        >>> q = gact_kernels.quantize(torch.randn(3, 100), 4, seed=1)
        >>> q
        QuantizedTensor(bits=4, group_size=256, seed=1, shape=torch.Size([3, 100]), stride=(100, 1), dtype=torch.float32, zero_exact=False, channel_dim=None, device=cpu, nbytes=166)
    """

    __slots__ = (
        "bits",
        "channel_dim",
        "data",
        "dtype",
        "group_size",
        "lo",
        "lossless_groups",
        "lossless_values",
        "scale",
        "seed",
        "shape",
        "stride",
        "zero_exact",
    )
    _BUFFERS = ("data", "lo", "scale", "lossless_groups", "lossless_values")

    data: torch.Tensor
    lo: torch.Tensor
    scale: torch.Tensor
    lossless_groups: torch.Tensor
    lossless_values: torch.Tensor
    bits: int
    group_size: int
    seed: int
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    zero_exact: bool
    channel_dim: int | None

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return self.shape.numel()

    @property
    def stored_numel(self) -> int:
        """Number of elements the codes cover: ``numel`` plus the padding of channel runs."""
        if self.channel_dim is None:
            return self.numel
        channels = self.shape[self.channel_dim]
        run = self.numel // channels
        return channels * padded_run(run, self.group_size)

    def _validate(self) -> None:
        check_bits(self.bits, "QuantizedTensor.bits")
        check_zero_exact(self.zero_exact, self.bits, "QuantizedTensor.zero_exact")
        check_group_size(self.group_size, "QuantizedTensor.group_size")
        check_seed(self.seed, "QuantizedTensor.seed")
        check_dtype(self.dtype, FLOAT_DTYPES, "QuantizedTensor.dtype")
        n = check_layout(self.shape, self.stride, "QuantizedTensor")
        if self.channel_dim is not None:
            check_channel_dim(self.channel_dim, len(self.shape), "QuantizedTensor.channel_dim")
            if not n:
                raise ValueError(
                    "QuantizedTensor.channel_dim must be None for an empty tensor (nothing to "
                    f"group); got {self.channel_dim} with shape {tuple(self.shape)}"
                )
        self._check_buffers()

    def _check_buffers(self) -> None:
        self._check_codes()
        self._check_lossless()

    def _check_codes(self) -> None:
        """Check the buffers whose addresses reach the kernels: codes, ``lo``, ``scale``."""
        n = self.stored_numel
        groups = -(-n // self.group_size)
        device = getattr(self.data, "device", None)
        code_bytes = (n * self.bits + 7) // 8
        check_buffer(self.data, "QuantizedTensor.data", torch.uint8, (code_bytes,), device)
        check_buffer(self.lo, "QuantizedTensor.lo", torch.float32, (groups,), device)
        check_buffer(self.scale, "QuantizedTensor.scale", torch.float32, (groups,), device)

    def _check_lossless(self) -> None:
        lossless = self.lossless_groups
        k = lossless.shape[0] if isinstance(lossless, torch.Tensor) and lossless.dim() else 0
        device = getattr(self.data, "device", None)
        check_buffer(lossless, "QuantizedTensor.lossless_groups", torch.int64, (k,), device)
        check_buffer(
            self.lossless_values,
            "QuantizedTensor.lossless_values",
            self.dtype,
            (k, self.group_size),
            device,
        )

    def _decompress(self) -> torch.Tensor:
        return dequantize(self)


def quantize(
    x: torch.Tensor,
    bits: int,
    *,
    group_size: int = 256,
    seed: int = 0,
    zero_exact: bool = False,
    channel_dim: int | None = None,
) -> QuantizedTensor:
    """Compresses ``x`` to ``bits`` bits per element with unbiased stochastic rounding.

    Each group of ``group_size`` consecutive elements (consecutive in memory) is stored as
    ``bits``-bit codes plus a float32 minimum and step (8 bytes per group). The rounding noise
    is a pure function of ``(seed, element index)``: the same input and seed give the same
    bytes on any thread count and on CPU and CUDA. A dense input (contiguous, channels-last,
    any permutation) is read in place and :func:`dequantize` restores its strides; other
    layouts are copied contiguous and come back contiguous. Groups holding NaN/Inf, or whose
    range is too small for a normal float32 step, are stored losslessly. On CUDA the kernel
    runs on the current stream and the call waits for it, to learn whether there are such
    groups (:func:`quantize_async` does not wait).

    With ``zero_exact=True`` (for ReLU outputs and other tensors whose zeros must stay
    zeros), every group whose minimum is zero (``+0`` or ``-0``: for a non-negative tensor,
    every group holding a zero) uses a sign-exact grid instead: code 0 means exactly 0 and is
    used only for elements equal to 0; positive elements are rounded stochastically (same
    noise) among the ``2**bits - 1`` levels ``tiny + k * step``, ``k = 0 .. 2**bits - 2``,
    with ``tiny = torch.finfo(x.dtype).tiny`` (the smallest positive *normal* number: 2**-126
    for float32 and bfloat16, 2**-14 for float16) and ``step = (max - tiny) / (2**bits - 2)``.
    So for a non-negative ``x``, ``dequantize(q) > 0`` exactly where ``x > 0`` and ``== 0``
    exactly where ``x == 0``, in every output dtype. The round trip stays unbiased for
    elements ``>= tiny``; a positive element below ``tiny`` comes back as ``tiny`` (a bias
    smaller than ``tiny``). The price is one level fewer for the positives: a step larger by
    about ``(2**bits - 1) / (2**bits - 2)`` (variance x2.25 at 2 bits, x1.15 at 4). Every
    other group (minimum below or above zero, lossless groups) is stored exactly as without
    the flag, so negative inputs are allowed (their groups keep the normal grid, and their
    signs are not guaranteed) and the size never changes.

    With ``channel_dim`` no group spans two channels of that dimension (NOTE [channel groups]
    in _layout.py): each channel's elements are grouped on their own, in runs padded to whole
    groups of at most ``group_size`` (the container's ``group_size`` is the one used). Use it
    for convolution-style activations (``channel_dim=1`` of NCHW or channels-last tensors),
    whose channels differ in scale. A contiguous tensor whose channel planes split into whole
    groups of between ``group_size / 2`` and ``group_size`` elements is stored in memory order
    with that group size (``channel_dim`` is then ``None``); any other is read in place on the
    CPU when contiguous or channels-last, and otherwise (and on CUDA) costs one copy each way.

    Args:
        x: dense float32, float16 or bfloat16 tensor of any shape, on CPU or CUDA.
        bits: code width, 1..8 (2..8 with ``zero_exact=True``).
        group_size: elements per group, a multiple of 8 in [8, 65536].
        seed: int in [0, 2**64); use a fresh seed per tensor and step.
        zero_exact: use the sign-exact grid for groups whose minimum is zero.
        channel_dim: group each channel of this dimension on its own (negative counts from
            the end), or ``None`` to group in memory order.

    Returns:
        A :class:`QuantizedTensor`; :func:`dequantize` restores shape, strides, dtype, device.

    Raises:
        ValueError: ``zero_exact=True`` with ``bits=1`` (one positive level cannot be
            unbiased), or a bad ``bits``, ``group_size``, ``seed``, ``channel_dim``, dtype or
            device.
        TypeError: ``x`` is not a tensor, or an argument has the wrong type.

    Example:
        >>> import torch, gact_kernels
        >>> x = torch.randn(4, 1000)
        >>> q = gact_kernels.quantize(x, 2, seed=7)
        >>> q.nbytes  # 1000 packed bytes + 16 groups * 8 bytes of metadata
        1128
        >>> gact_kernels.dequantize(q).shape
        torch.Size([4, 1000])
        >>> r = torch.tensor([0.0, 1e-40, 0.5, 3.0] * 64)  # a ReLU output
        >>> y = gact_kernels.dequantize(gact_kernels.quantize(r, 2, zero_exact=True))
        >>> torch.equal(y > 0, r > 0), y[1].item() == torch.finfo(torch.float32).tiny
        (True, True)
        >>> a = torch.randn(50, 512, 1, 1) * torch.logspace(-3, 1, 512).view(1, -1, 1, 1)
        >>> c = gact_kernels.quantize(a, 4, channel_dim=1)  # 1x1 maps: 512 channels of 50
        >>> c.group_size, c.stored_numel  # each channel in one group of 56 (6 padded)
        (56, 28672)
        >>> err = (gact_kernels.dequantize(c) - a).std((0, 2, 3)) / a.std((0, 2, 3))
        >>> bool(err.max() < 0.3)  # every channel keeps its own precision
        True
    """
    return quantize_async(
        x, bits, group_size=group_size, seed=seed, zero_exact=zero_exact, channel_dim=channel_dim
    ).result()


def quantize_async(
    x: torch.Tensor,
    bits: int,
    *,
    group_size: int = 256,
    seed: int = 0,
    zero_exact: bool = False,
    channel_dim: int | None = None,
) -> PendingQuantize:
    """:func:`quantize` without waiting for the device: on CUDA the kernel is enqueued and the
    call returns at once, holding ``x`` until the kernel tells whether it stored a group
    losslessly (NOTE [Deferred lossless check] in pending.py). Same arguments, same bytes.

    Returns:
        A :class:`PendingQuantize`; its ``result()`` is what :func:`quantize` returns.

    Example:
        >>> import torch, gact_kernels
        >>> p = gact_kernels.quantize_async(torch.tensor([1.0, float("nan")] * 200), 2)
        >>> p.result().lossless_groups.tolist()  # both groups of 256 hold a NaN
        [0, 1]
    """
    check_tensor(x, "x", FLOAT_DTYPES)
    bits = check_bits(bits)
    group_size = check_group_size(group_size)
    seed = check_seed(seed)
    zero_exact = check_zero_exact(zero_exact, bits)
    if x.requires_grad:  # a pending call holds it: never its autograd graph
        x = x.detach()
    device = x.device
    if channel_dim is not None:
        channel_dim = check_channel_dim(channel_dim, x.dim())
        plane = plane_group(math.prod(x.shape[channel_dim + 1 :]), group_size)
        if x.numel() == 0:
            channel_dim = None
        elif x.is_contiguous() and plane is not None:
            group_size, channel_dim = plane, None  # memory order keeps groups inside channels
    runs = None  # the CPU kernels read channel runs in place: no copy (NOTE [channel groups])
    if channel_dim is None:
        flat, stride = memory_order(x)
        n = x.numel()
    else:
        group_size, padded = channel_grouping(x.shape, channel_dim, group_size)
        stride = restore_stride(x)
        if device.type == "cpu":
            runs = channel_runs(x, channel_dim, padded)
        flat = x if runs is not None else to_channel_runs(x, channel_dim, group_size)
        n = x.shape[channel_dim] * padded
    groups = -(-n // group_size)
    data = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=device)
    lo = torch.empty(groups, dtype=torch.float32, device=device)
    scale = torch.empty(groups, dtype=torch.float32, device=device)
    code = DTYPE_CODES[x.dtype]
    q = QuantizedTensor._built(
        data=data, lo=lo, scale=scale, bits=bits, group_size=group_size, seed=seed,
        shape=x.shape, stride=stride, dtype=x.dtype, zero_exact=zero_exact,
        channel_dim=channel_dim, **_no_lossless(device, x.dtype, group_size),
    )  # fmt: skip
    if device.type == "cuda":
        return _enqueue(q, flat, code, n)
    found = 0
    if runs is not None:
        found = launch(
            "quantize_runs", device, x.data_ptr(), code, *runs, group_size, bits, seed,
            zero_exact, data.data_ptr(), lo.data_ptr(), scale.data_ptr(),
        )  # fmt: skip
        if found:  # rare (NaN/Inf): the lossless groups are gathered from the block
            flat = to_channel_runs(x, channel_dim, group_size)
    elif n:
        found = launch(
            "quantize", device, flat.data_ptr(), code, n, group_size, bits, seed, zero_exact,
            data.data_ptr(), lo.data_ptr(), scale.data_ptr(),
        )  # fmt: skip
    if found:
        groups, values = lossless_groups(flat, scale, group_size)
        q = q._with(lossless_groups=groups, lossless_values=values)
    return PendingQuantize(q)


def _enqueue(q: QuantizedTensor, flat: torch.Tensor, code: int, n: int) -> PendingQuantize:
    """Launch the CUDA kernel on the block ``flat`` (``n`` elements) into ``q``'s buffers;
    the lossless check is deferred (NOTE [Deferred lossless check] in pending.py)."""
    ring = flag_ring()
    slot = ring.take() if ring.usable else (0, -1)
    launch(
        "quantize", flat.device, flat.data_ptr(), code, n, q.group_size, q.bits, q.seed,
        q.zero_exact, q.data.data_ptr(), q.lo.data_ptr(), q.scale.data_ptr(),
        ring.address + slot[0] if ring.usable else 0,
    )  # fmt: skip
    event = torch.cuda.Event()
    event.record(current_stream(flat.device.index))
    return PendingQuantize(q, flat, event, ring if ring.usable else None, slot)


# Shared empty lossless buffers, per (device, dtype, group size): most containers have no
# lossless group, and two allocations per call cost more than the kernel on small inputs.
_EMPTY: dict[tuple[torch.device, torch.dtype, int], dict[str, torch.Tensor]] = {}


def _no_lossless(device: torch.device, dtype: torch.dtype, group_size: int) -> dict:
    """``lossless_groups`` and ``lossless_values`` of a container without lossless groups."""
    key = (device, dtype, group_size)
    empty = _EMPTY.get(key)
    if empty is None:
        empty = _EMPTY[key] = {
            "lossless_groups": torch.empty(0, dtype=torch.int64, device=device),
            "lossless_values": torch.empty((0, group_size), dtype=dtype, device=device),
        }
    return empty


def rounding_steps(q: QuantizedTensor) -> torch.Tensor:
    """The step of the grid each element of ``q`` was rounded on, as a float32 tensor of
    ``q``'s shape and strides: its group's ``scale`` (on the sign-exact grid of ``zero_exact``
    groups, the step above ``tiny``), and 0 in lossless groups.

    An element ``x`` stochastically rounded to ``x̂`` on a grid of step ``s`` has, with
    ``d = |x̂ - x|``, rounding variance exactly ``d * (s - d)`` (``t (1 - t) s²`` whichever
    way it went): the per-element variance of a round trip, without a second draw.

    Args:
        q: the result of :func:`quantize`.

    Example:
        >>> import torch, gact_kernels
        >>> q = gact_kernels.quantize(torch.tensor([0.0, 0.3, 1.5]), 2, group_size=8)
        >>> gact_kernels.rounding_steps(q).tolist()
        [0.5, 0.5, 0.5]
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor, got {type(q).__name__}")
    # every code at its largest value, on a grid from 0: dequantizes to levels * scale in
    # the layout of q, which dequantize already knows (channel runs included)
    probe = dataclasses.replace(
        q,
        data=torch.full_like(q.data, 0xFF),
        lo=torch.zeros_like(q.lo),
        scale=torch.nan_to_num(q.scale, nan=0.0),
        lossless_groups=q.lossless_groups[:0],
        lossless_values=torch.empty((0, q.group_size), device=q.device),
        dtype=torch.float32,
        zero_exact=False,
    )
    return dequantize(probe).div_((1 << q.bits) - 1)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Decompresses ``q`` to a new tensor of its original shape, strides, dtype and device.

    Each element comes back as the level of its code, ``lo + code * scale`` in float32 (on
    the sign-exact grid of ``q.zero_exact`` groups: 0 for code 0, else
    ``tiny + (code - 1) * scale``); float16 and bfloat16 outputs round that level
    *stochastically* to their grid (with a stream derived from ``q.seed``), so the round trip
    stays unbiased in the output dtype; float32 outputs round it to nearest. Asynchronous on
    CUDA (current stream, no synchronisation).

    Args:
        q: the result of :func:`quantize` (possibly moved with ``q.to(...)``).

    Returns:
        A new tensor; lossless groups (NaN/Inf, tiny ranges) come back bit-exact.

    Example:
        >>> import torch, gact_kernels
        >>> x = torch.full((300,), 1.5).t()
        >>> torch.equal(gact_kernels.dequantize(gact_kernels.quantize(x, 1)), x)
        True
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor, got {type(q).__name__}")
    # The lossless buffers are read by torch indexing only, so they are checked (for a clear
    # message) only where there is something to read (NOTE [container invariants]).
    q._check_codes()
    lossless = not isinstance(q.lossless_groups, torch.Tensor) or q.lossless_groups.numel() > 0
    if lossless:
        q._check_lossless()
    out = empty_with_layout(q.shape, q.stride, q.dtype, q.device)
    if q.channel_dim is not None and q.device.type == "cpu" and not lossless:
        channels = q.shape[q.channel_dim]
        runs = channel_runs(out, q.channel_dim, q.stored_numel // channels)
        if runs is not None:  # written in place (NOTE [channel groups])
            launch(
                "dequantize_runs", q.device, q.data.data_ptr(), q.lo.data_ptr(),
                q.scale.data_ptr(), *runs, q.group_size, q.bits, q.seed, q.zero_exact,
                DTYPE_CODES[q.dtype], out.data_ptr(),
            )  # fmt: skip
            return out
    if q.channel_dim is None:
        flat = out  # dense (its strides were checked to be): its address starts the block
    else:
        flat = torch.empty(q.stored_numel, dtype=q.dtype, device=q.device)
    n = flat.numel()
    if n:
        launch(
            "dequantize", q.device, q.data.data_ptr(), q.lo.data_ptr(), q.scale.data_ptr(), n,
            q.group_size, q.bits, q.seed, q.zero_exact, DTYPE_CODES[q.dtype], flat.data_ptr(),
        )  # fmt: skip
    if lossless:
        if q.channel_dim is None:
            flat = flat_view(out)
        flat[element_index(q.lossless_groups, q.group_size, n)] = q.lossless_values
    if q.channel_dim is not None:
        from_channel_runs(flat, out, q.channel_dim)
    return out
