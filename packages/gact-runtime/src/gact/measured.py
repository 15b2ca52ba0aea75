"""Sensitivities measured in an ordinary backward, for saves read linearly into a parameter's
gradient (no probe needed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import gact_kernels
import gact_policy
import torch

from . import decisions, linear_rules, rotation
from .decision_spec import BatchNormUse, DecisionSpec, LinearUse
from .measured_compiled import Fingerprint, fingerprint
from .measured_norms import Normalised, Producer
from .measured_pointwise import Curved, Rows

if TYPE_CHECKING:
    from .saved import SavedCompressed

__all__ = ["TRIAL_BITS", "SensitivityMeter", "Trial", "rounding_variance"]

#: the width of a throwaway quantization measuring a save not quantized as it is (kept at full
#: precision, a derivative table) or measured in parts (NOTE [Measured pointwise inputs])
TRIAL_BITS = 8
#: a throwaway quantization of (a part of) a saved tensor at ``TRIAL_BITS``, in the layout a
#: quantized save of it would have if it has rank 2 or 3 (memory order or feature groups)
Trial = Callable[[torch.Tensor], gact_kernels.QuantizedTensor]

_P = TypeVar("_P", Producer, Rows)

# NOTE [Measured sensitivities]
# The input ``x`` of a linear layer, of a product with a parameter (``x @ W``, ``addmm``) or of
# a convolution reaches the gradient only through that parameter's gradient, and linearly: with
# the output's gradient ``g``, ``grad W = g^T x`` over rows ``n`` (for a convolution, the
# correlation of ``g`` with ``x``), while the input's gradient ``g W`` does not read ``x``.
# Rounding ``x`` to ``x + ε``, with independent zero-mean errors, therefore adds exactly
#
#     E‖g^T ε‖² = Σ_n ‖g_n‖² Σ_l Var ε_nl        (linear, matmul)
#     E‖Δ grad W‖² = Σ_{n,q} T_n(q) Σ_i Var ε_niq  (convolution)
#
# to the squared gradient error, nothing more, where ``T_n(q)`` sums ``‖g_n(p)‖²`` (over output
# channels of ``q``'s group) over every output position ``p`` whose window covers input
# position ``q``: the input gradient of a convolution with a kernel of ones. Divided by
# ``S(b)``, that is the key's sensitivity ``c`` of NOTE [Variance model] in gact_policy, in the
# same unit the probes measure (their sketch keeps squared norms), with no extra forward or
# backward. The per-element variance is not modelled but read off the stored rounding: with
# ``d = |x̂ - x|`` and the element's grid step ``s`` (``gact_kernels.rounding_steps``, in any
# group layout: channel and row groups, lossless groups at 0, the zero-exact grid; a rotated
# save's in its rotated form, then spread over its block: NOTE [Rotated groups]), it is
# exactly ``d (s - d) = t (1 - t) s²`` whichever way the element was rounded, so the
# measurement carries no rounding noise of its own (a single ``d²`` would: 20% off on a tensor
# of 384 elements). It is taken once at the save, from the dequantized payload, and summed
# per row (per sample, group of channels and position for a convolution). A hook on the call's
# output receives ``g`` in the backward and adds the key's term, on the device; the terms are
# read once, when the adaptation runs. A key an allocation keeps at full precision is measured
# the same way through a throwaway 8-bit quantization of its tensor.
#
# A key is *measured* when every save at it during the step was read that way or only through
# exact decisions (``DecisionSpec.only_decisions``: ReLU's output on the zero-exact grid, which
# the following convolution or linear layer also reads, LeakyReLU's sign, Hardtanh's range:
# their rounding never reaches the gradient, sensitivity 0), or is two-valued (stored exactly
# at its pinned 1 bit: NOTE [Two-valued tensors] in adapt.py); any other reader
# (normalisations, attention, pointwise derivatives, products of two activations) leaves it
# to the probes, but for BatchNorm inputs that such a layer produced (NOTE [Measured BatchNorm
# inputs] in measured_norms.py) and GELU or SiLU inputs that a linear layer produced (NOTE
# [Measured pointwise inputs] in measured_pointwise.py). Cost, on the steps the meter runs
# only: one dequantization and one reduction per measured save, one reduction (a ones-kernel
# convolution) per backward; counted as adaptation time (``seconds``).


class SensitivityMeter:
    """Measures the sensitivities of the keys whose saves are read linearly (NOTE above) over
    the forwards and backwards that run while it is attached to a controller's hooks.

    Args:
        batch_norms: measure the inputs of BatchNorm modules a measured layer produced (NOTE
            [Measured BatchNorm inputs] in measured_norms.py); ``False`` for models without
            any (their producers' quantities would go unused).

    Example::

        >>> import torch
        >>> from gact import Controller, GactConfig
        >>> layer, meter = torch.nn.Linear(64, 8), SensitivityMeter()
        >>> with Controller(layer, GactConfig.from_level("L1", min_numel=0)) as controller:
        ...     controller.hooks.meter = meter  # what the controller does on measuring steps
        ...     meter.start()
        ...     layer(torch.randn(32, 64)).square().sum().backward()
        ...     meter.stop()
        >>> c = meter.sensitivities()  # {key: sensitivity} of the measured keys
        >>> list(c), c["<root>#0:float32:2d"] > 0
        (['<root>#0:float32:2d'], True)
    """

    def __init__(self, *, batch_norms: bool = True, fingerprints: bool = False) -> None:
        self._batch_norms = batch_norms
        self._terms: dict[str, list[torch.Tensor]] = {}
        self._waiting: dict[int, _Measurement] = {}  # measurements whose backward has not run
        self.seen: set[str] = set()  # keys saved while the meter ran
        self.probed: set[str] = set()  # ... among them, read some way the meter cannot measure
        self.seconds = 0.0
        self._producers: tuple[Producer | Rows, ...] = ()  # of the last measured call
        # NOTE [Measured compiled saves] in measured_compiled.py: the saves' fingerprints by
        # key (of compiled graphs' saves, and of every observed save if ``fingerprints``), and
        # the sensitivities compiled keys took from an eager run's measurement
        self._fingerprinting = fingerprints
        self.fingerprints: dict[str, list[Fingerprint]] = {}
        self._adopted: dict[str, float] = {}

    def start(self) -> None:
        """Make linear calls publish their use (``linear_rules.measuring``) until ``stop()`` or
        until nothing holds the meter any more."""
        linear_rules.set_measuring(self, True)

    def stop(self) -> None:
        linear_rules.set_measuring(self, False)
        self._producers = ()

    def saved(
        self,
        saved: SavedCompressed,
        tensor: torch.Tensor,
        spec: DecisionSpec | None,
        trial: Trial,
        *,
        readable: bool = True,
    ) -> None:
        """``tensor`` was saved as ``saved`` (quantized or a derivative table, or a
        deduplicated save of it) during a call with ``spec``: measure it if the call's use of
        it is measurable; ``trial``: a throwaway quantization of any part of ``tensor`` (NOTE
        [Measured pointwise inputs]); ``readable``: whether the payload holds ``tensor``'s
        elements in its memory order (not for every view of the tensor ``saved`` holds: that
        view's reader is then probed)."""
        whole = (  # the payload holds the tensor's own values (not log-probabilities' exp)
            readable
            and saved.table is None
            and saved.logged_by is None
            and saved.expand_to is None
            and saved.ticket is None
        )
        payload = lambda: saved.held if whole else None  # noqa: E731
        self._observe(saved.key, tensor, spec, payload, trial, saved.rotated)

    def kept(
        self,
        key: str,
        tensor: torch.Tensor,
        spec: DecisionSpec | None,
        trial: Trial,
    ) -> None:
        """``tensor`` was kept at full precision at ``key`` by an allocation: measure what
        ``trial(tensor)`` (a throwaway quantization) would add, if the call's use of it is
        measurable."""
        self._observe(key, tensor, spec, lambda: trial(tensor), trial)

    def compiled(self, key: str, tensor: torch.Tensor) -> None:
        """A compiled graph saved ``tensor`` at ``key``: not measurable here, but fingerprinted
        for ``adopt`` (NOTE [Measured compiled saves] in measured_compiled.py)."""
        start = time.perf_counter()
        self.seen.add(key)
        self.probed.add(key)
        self.fingerprints.setdefault(key, []).append(fingerprint(tensor))
        self.seconds += time.perf_counter() - start

    def adopt(self, sensitivities: dict[str, float]) -> None:
        """Take these sensitivities of compiled keys, measured on an eager run of the step."""
        self._adopted.update(sensitivities)
        self.probed.difference_update(sensitivities)

    def _observe(
        self,
        key: str,
        tensor: torch.Tensor,
        spec: DecisionSpec | None,
        payload: Callable[[], gact_kernels.Compressed | None],
        trial: Trial,
        rotated: rotation.Rotated | None = None,
    ) -> None:
        start = time.perf_counter()
        self.seen.add(key)
        if self._fingerprinting:
            self.fingerprints.setdefault(key, []).append(fingerprint(tensor))
        measurable = True
        if spec is not None and spec.derivative is not None and id(tensor) == spec.derivative_id:
            measurement = _Measurement.curved(self, key, tensor, spec.derivative, trial)
        elif spec is not None and (use := spec.linear or spec.batch_norm) and use.reads(tensor):
            measurement = _Measurement.of(self, key, payload(), tensor, use, rotated)
        else:  # read only through exact decisions (no noise), or in a way not measured here
            measurement, measurable = None, False
        if measurement is not None:
            self._waiting[id(measurement)] = measurement
            decisions.await_output(measurement)
        elif measurable or spec is None or not spec.only_decisions:
            self.probed.add(key)
        self.seconds += time.perf_counter() - start

    def add(self, measurement: _Measurement, term: torch.Tensor | None) -> None:
        """The backward of ``measurement`` ran: ``term`` is its sensitivity (``None``: it could
        not be measured)."""
        self._waiting.pop(id(measurement), None)
        if term is None:
            self.probed.add(measurement.key)
        else:
            self._terms.setdefault(measurement.key, []).append(term)

    def produced(self, out: torch.Tensor, source: torch.Tensor, use: LinearUse) -> None:
        """A measured call with ``use`` read ``source`` and returned ``out``: keep what a
        BatchNorm (if the model has BatchNorms: NOTE [Measured BatchNorm inputs]) or a GELU or
        SiLU (NOTE [Measured pointwise inputs]) reading ``out`` next needs of them."""
        if any(p.output() is out for p in self._producers):
            return
        found = (Producer.of(out, source, use) if self._batch_norms else None,)
        self._producers = tuple(p for p in (*found, Rows.of(out, source, use)) if p is not None)

    def producer_of(self, x: torch.Tensor, kind: type[_P]) -> _P | None:
        """The ``kind`` record of the measured call that produced ``x`` as it is now, if it was
        the last one."""
        for producer in self._producers:
            if isinstance(producer, kind) and producer.output() is x:
                return producer if x._version == producer.version else None
        return None

    def sensitivities(self) -> dict[str, float]:
        """The measured keys' sensitivities, summed over their saves (one device
        synchronisation per device); keys whose measured backward never ran are left out."""
        start = time.perf_counter()
        unfinished = {m.key for m in self._waiting.values()}
        keys = sorted(self.seen - self.probed - unfinished)
        # read only through exact decisions (no noise), or measured on an eager run
        out = {key: self._adopted.get(key, 0.0) for key in keys}
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for key in keys:
            for term in self._terms.get(key, ()):
                by_device.setdefault(term.device, []).append((key, term))
        for rows in by_device.values():
            values = torch.stack([t for _, t in rows]).double().cpu().tolist()
            for (key, _), value in zip(rows, values):
                out[key] += value
        self.seconds += time.perf_counter() - start
        return out


class _Measurement:
    """One measured save: its rounding error mass (per row, or per sample and channel group;
    per sample and channel for a BatchNorm's input, per block of rows and column for a GELU's),
    waiting for its call's output gradient, and for a producer's input, ``source``, until the
    call returns; ``derived``: a BatchNorm's or GELU's quantities, ``None`` for a linear use."""

    __slots__ = ("derived", "factor", "key", "mass", "meter", "source", "use")

    def __init__(
        self,
        meter: SensitivityMeter,
        key: str,
        mass: torch.Tensor,
        bits: int,
        use: LinearUse | BatchNormUse | str,
        *,
        derived: Normalised | Curved | None = None,
        source: torch.Tensor | None = None,
    ) -> None:
        self.meter, self.key, self.mass, self.use = meter, key, mass, use
        self.derived, self.source = derived, source
        self.factor = float(gact_policy.variance_factor(bits))

    @classmethod
    def of(
        cls,
        meter: SensitivityMeter,
        key: str,
        payload: gact_kernels.Compressed | None,
        tensor: torch.Tensor,
        use: LinearUse | BatchNormUse,
        rotated: rotation.Rotated | None = None,
    ) -> _Measurement | None:
        """The measurement of ``tensor`` stored as ``payload`` (``None`` or not a quantized
        container holding its values as they are, or in their ``rotated`` form: not
        measurable; nor is a BatchNorm input no measured producer made)."""
        if not isinstance(payload, gact_kernels.QuantizedTensor):
            return None
        producer = None
        if isinstance(use, BatchNormUse):  # NOTE [Measured BatchNorm inputs]
            producer = meter.producer_of(tensor, Producer)
            if producer is None or rotated is not None:
                return None
        with torch.no_grad():
            held = tensor.detach() if rotated is None else rotated.held_form(tensor.detach())
            error = rounding_variance(payload, held)
            if rotated is not None:  # NOTE [Rotated groups]
                error = rotated.spread(error)
            if producer is not None:
                found = producer.normalised(tensor, use, payload, error)
                return cls(meter, key, found.mass, payload.bits, use, derived=found)
            if use.conv is None:
                mass = error.reshape(-1, tensor.shape[-1]).sum(1)
            else:
                groups = use.conv[3]
                n, c = tensor.shape[:2]
                mass = error.view(n, groups, c // groups, *tensor.shape[2:]).sum(2)
        return cls(meter, key, mass, payload.bits, use, source=tensor)

    @classmethod
    def curved(
        cls, meter: SensitivityMeter, key: str, tensor: torch.Tensor, function: str, trial: Trial
    ) -> _Measurement | None:
        """The measurement of ``function``'s input ``tensor`` through throwaway quantizations
        of its parts (``trial``), if a measured linear layer produced it (NOTE [Measured
        pointwise inputs])."""
        rows = meter.producer_of(tensor, Rows)
        if rows is None:
            return None

        def variance(part: torch.Tensor) -> torch.Tensor:
            return rounding_variance(trial(part), part)

        found = rows.curved(tensor, function, variance)
        return cls(meter, key, found.mass, TRIAL_BITS, function, derived=found)

    def called(self, out: Any) -> None:
        """The call returned ``out``: its gradient is ``g`` (see ``decisions.await_output``);
        a BatchNorm's node also gives its weight's gradient."""
        source, self.source = self.source, None
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            self.meter.add(self, None)
            return
        node = out.grad_fn
        if isinstance(self.derived, Normalised) and "BatchNorm" in type(node).__name__:
            node.register_hook(self._node)
        else:
            out.register_hook(self._grad)
        if source is not None:
            start = time.perf_counter()
            self.meter.produced(out, source, self.use)
            self.meter.seconds += time.perf_counter() - start

    def _node(self, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        """A BatchNorm's node ran: its output's gradient, and its inputs' (input, weight,
        bias)."""
        weight = grad_inputs[1] if len(grad_inputs) > 1 else None
        self._grad(grad_outputs[0], weight)

    def _grad(self, g: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            if self.derived is not None:
                term = self.derived.term(g.detach(), weight)
            else:
                term = _term(self.mass, g.detach(), self.use)
        self.meter.add(self, None if term is None else term / self.factor)
        self.meter.seconds += time.perf_counter() - start


def _term(mass: torch.Tensor, g: torch.Tensor, use: LinearUse) -> torch.Tensor | None:
    """``Σ ‖g_n‖² mass_n`` (NOTE [Measured sensitivities]); ``None`` if the shapes disagree."""
    square = g.float().square()
    if use.conv is None:
        rows = square.reshape(-1, g.shape[-1]).sum(1)
        return None if rows.shape != mass.shape else rows.dot(mass)
    stride, padding, dilation, groups, kernel = use.conv
    n, out_channels = g.shape[:2]
    if g.dim() != mass.dim() or n != mass.shape[0] or out_channels % groups:
        return None
    square = square.view(n, groups, out_channels // groups, *g.shape[2:]).sum(2)
    ones = torch.ones((groups, 1, *kernel), dtype=square.dtype, device=square.device)
    reach = _CONV_INPUT[len(kernel)](
        mass.shape, ones, square, stride=stride, padding=padding, dilation=dilation, groups=groups
    )
    return reach.mul_(mass).sum()


_CONV_INPUT = {
    1: torch.nn.grad.conv1d_input,
    2: torch.nn.grad.conv2d_input,
    3: torch.nn.grad.conv3d_input,
}


def rounding_variance(payload: gact_kernels.QuantizedTensor, held: torch.Tensor) -> torch.Tensor:
    """Per element of ``held`` (the values ``payload`` quantized, in its shape), the variance
    of their stochastic rounding, exactly ``d (s - d)`` with ``d = |x̂ - x|`` and the grid step
    ``s`` (``gact_kernels.rounding_steps``; NOTE [Measured sensitivities]), in float32."""
    values = gact_kernels.decompress(payload).view(held.shape)
    steps = gact_kernels.rounding_steps(payload).view(held.shape)
    d = values.float().sub_(held.float()).abs_().nan_to_num_(0.0)
    return steps.sub_(d).mul_(d).clamp_(min=0.0)
