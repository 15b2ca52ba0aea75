"""Optimization levels and the validated configuration object.

The level table is the single source of truth for what each level means; the README's table
is generated from the same facts. ``set_optimization_level`` changes the default configuration
that new controllers take; a live controller changes level with ``Controller.configure``.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import gact_policy
from gact_kernels import MAX_GROUP_SIZE

from .errors import ConfigError

__all__ = ["LEVELS", "GactConfig", "Level", "get_config", "set_optimization_level"]


@dataclass(frozen=True)
class Level:
    """What one optimization level does.

    Args:
        bits: fixed width for every compressed tensor, or ``None`` for adaptive levels.
        avg_bits: average bits per element for adaptive levels, per-group metadata included.
        swap: move compressed payloads to pinned CPU memory (CUDA only).
        description: one line for tables and logs.
    """

    bits: int | None
    avg_bits: float | None
    swap: bool
    description: str

    @property
    def compresses(self) -> bool:
        return self.bits is not None or self.avg_bits is not None

    @property
    def adaptive(self) -> bool:
        return self.avg_bits is not None


LEVELS: dict[str, Level] = {
    "L0": Level(None, None, False, "no compression (saved tensors measured, stored as they are)"),
    "L1": Level(4, None, False, "every activation at 4 bits"),
    "L1.1": Level(8, None, False, "every activation at 8 bits"),
    "L1.2": Level(2, None, False, "every activation at 2 bits"),
    "L2": Level(None, 4.0, False, "adaptive bits, 4 bits per element on average"),
    "L2.1": Level(None, 3.0, False, "adaptive bits, 3 bits per element on average"),
    "L2.2": Level(None, 2.0, False, "adaptive bits, 2 bits per element on average"),
    "L3": Level(None, 4.0, True, "L2 plus swap of compressed tensors to pinned CPU memory"),
}

_SENSITIVITY_METHODS = ("pairwise", "probe")


@dataclass(frozen=True)
class GactConfig:
    """Validated GACT configuration.

    Args:
        level: one of ``LEVELS`` (``"L0"`` ... ``"L3"``).
        group_size: elements per quantization group (one fp32 ``lo`` and one fp32 ``scale`` each).
        min_numel: floating-point tensors with fewer elements are kept as they are.
        adapt_interval: adaptive levels re-estimate sensitivities at step 0, at the doubling
            steps ``adapt_first_gap``, 2x, 4x, ... below ``adapt_interval``, and every
            ``adapt_interval`` steps (``gact_policy.AdaptationSchedule``).
        adapt_first_gap: steps before the first probing adaptation (the first step allocates
            without probes, NOTE [Prior allocation]); ``0`` is the original GACT's schedule:
            probes at step 0 and every ``adapt_interval`` steps.
        adapt_budget: probing adaptations (but one at step 0) wait while they would make the
            time spent adapting exceed this fraction of the training time, were they 25% dearer
            than predicted (``gact_policy.AdaptationSchedule``'s ``margin``). The check reads
            the clock, so which steps adapt, and the training with them, vary from run to run;
            ``None`` sets no budget: every scheduled adaptation runs, and a run is reproducible
            (same seed, same model, same batches: same bits and gradients).
        sensitivity_method: ``"pairwise"`` (``gact_policy.pairwise_sensitivity``: about
            ``sqrt(2L)`` probes for ``L`` tensors, each re-seeding a set of tensors) or ``"probe"``
            (``gact_policy.probe_sensitivity``, the paper's Algorithm 1: ``L + 1`` probes).
        num_probes: probes of the ``"pairwise"`` method; ``None`` (or fewer than needed) takes
            the minimum, ``gact_policy.min_pair_probes(L)``. More probes, lower estimation error.
        measure_linear: measure, in the step's own backward, the sensitivities of tensors read
            only linearly into a parameter's gradient (inputs of linear layers, convolutions
            and products with a parameter; NOTE [Measured sensitivities] in measured.py), and
            probe only the others; a model whose tensors are all measured then adapts without
            probes, in ``step()`` loops too. ``False`` probes every tensor.
        sensitivity_momentum: weight of the previous estimate in the exponential moving average
            of sensitivities (``gact_policy.smooth``'s ``momentum``), in ``[0, 1)``.
        seed: base seed of the stochastic rounding streams.
        memory_budget: adaptive levels only: bytes the saved tensors of one step may occupy,
            everything counted (payloads, metadata, decision masks and the tensors kept as they
            are); replaces the level's average bits. ``None`` uses the level's average.
        derivative_tables: store GELU and SiLU inputs due for at most 4 bits as derivative
            tables where that is more accurate than quantizing them (NOTE [Derivative tables]
            in pointwise.py); ``False`` always quantizes them.
        channel_groups: quantize tensors of rank 4 or more (NCHW, NCDHW, and their
            channels-last layouts) with groups that never span two channels of dim 1
            (NOTE [channel groups] in gact_kernels/_layout.py), tensors of rank 2 and 3 with
            groups that never span two features of the last dimension (NOTE [Feature groups]
            in storing.py), and the inputs of LayerNorm and RMSNorm with groups that never span
            two rows (NOTE [Attention and row normalisations] in decision_rules.py): a channel's,
            feature's or row's precision then never depends on the range of another.
            ``False`` groups every tensor in memory order, as the original GACT did (it
            diverged on a ResNet-18 at 32x32, whose last stage has 1x1 maps: BENCHMARKS.md,
            "Stability").
        rotated_groups: quantize a heavy-tailed tensor (one whose groups' ranges a few large
            elements set, such as the SwiGLU product a LLaMA MLP's down projection reads) after
            a randomized Hadamard rotation of each group, where that cuts the expected rounding
            error at least in half (NOTE [Rotated groups] in rotation.py); costs a transform at
            its pack and unpack, no bytes. ``False`` never rotates.
        recompute_activations: store only the input of a call of an activation written as
            several elementwise operations (transformers' ``gelu_new``, ``gelu_fast``,
            ``gelu_accurate`` and ``quick_gelu``), and recompute the intermediates the
            operations saved from it in the backward (NOTE [Recomputed activations] in
            recomputed.py): transformers' GPT-2 4x128 stores 28% fewer bytes at every level
            that compresses, and its CPU step takes 5-6 points of fp32's more. ``False``
            stores every intermediate.
        compress_checkpoint_inputs: also compress the tensors ``torch.utils.checkpoint`` keeps
            for its regions (their inputs). ``False`` (the default) keeps them as they are, so
            the region's recomputation, and the gradient it gives, stay exact; ``True`` saves
            their memory but makes the region's gradient that of its dequantized input, biased
            wherever the region decides (ReLU and the like: NOTE [Checkpointed regions] in
            origins.py).
        compress_custom_functions: also compress what a ``torch.autograd.Function`` of the
            user's or of a library (not GACT's own) saves with ``ctx.save_for_backward``.
            ``False`` (the default) keeps it as it is: the function's backward is code GACT
            cannot read, and one that decides on a save (a hand-written ReLU's ``x > 0``)
            gives a biased gradient from a rounded one (NOTE [Custom functions] in origins.py);
            ``True`` saves its memory where every such backward reads its saves linearly.

    Example::

        >>> cfg = GactConfig.from_level("L2", adapt_interval=500)
        >>> cfg.avg_bits
        4.0
    """

    level: str = "L2"
    group_size: int = 256
    min_numel: int = 1024
    adapt_interval: int = 1000
    adapt_first_gap: int = 10
    adapt_budget: float | None = 0.05
    sensitivity_method: str = "pairwise"
    num_probes: int | None = None
    measure_linear: bool = True
    sensitivity_momentum: float = 0.5
    seed: int = 0
    memory_budget: int | None = None
    derivative_tables: bool = True
    channel_groups: bool = True
    rotated_groups: bool = True
    recompute_activations: bool = True
    compress_checkpoint_inputs: bool = False
    compress_custom_functions: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.level, str) or self.level not in LEVELS:
            raise ConfigError(
                f"unknown optimization level {self.level!r}; valid levels: {', '.join(LEVELS)}"
            )
        _check_int("group_size", self.group_size, 8, MAX_GROUP_SIZE)
        if self.group_size % 8:
            raise ConfigError(
                f"group_size must be a multiple of 8 in [8, {MAX_GROUP_SIZE}] (gact_kernels' "
                f"rule), got {self.group_size!r}"
            )
        avg = LEVELS[self.level].avg_bits
        if avg is not None and avg < 1 + self.overhead_bits:
            smallest = next(g for g in range(8, MAX_GROUP_SIZE + 1, 8) if 1 + 64 / g <= avg)
            raise ConfigError(
                f"level {self.level} averages {avg} bits per element, metadata included, but "
                f"group_size={self.group_size} already costs {self.overhead_bits} bits of "
                f"metadata per element on top of at least 1 bit of data; use group_size >= "
                f"{smallest} or a level with more bits"
            )
        _check_int("min_numel", self.min_numel, 0)
        _check_int("adapt_interval", self.adapt_interval, 1)
        _check_int("adapt_first_gap", self.adapt_first_gap, 0)
        budget = self.adapt_budget
        if budget is not None and (not _is_real(budget) or not 0.0 <= budget < float("inf")):
            raise ConfigError(f"adapt_budget must be a fraction >= 0 or None, got {budget!r}")
        if self.sensitivity_method not in _SENSITIVITY_METHODS:
            raise ConfigError(
                f"sensitivity_method must be one of {_SENSITIVITY_METHODS}, "
                f"got {self.sensitivity_method!r}"
            )
        if self.num_probes is not None:
            _check_int("num_probes", self.num_probes, 2, none_ok=True)
        momentum = self.sensitivity_momentum
        if not _is_real(momentum) or not 0.0 <= momentum < 1.0:
            raise ConfigError(f"sensitivity_momentum must be a number in [0, 1), got {momentum!r}")
        _check_int("seed", self.seed, 0, 2**64 - 1)
        for flag in (
            "measure_linear", "derivative_tables", "channel_groups", "rotated_groups",
            "recompute_activations", "compress_checkpoint_inputs", "compress_custom_functions",
        ):  # fmt: skip
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} must be True or False, got {value!r}")
        if self.memory_budget is not None:
            _check_int("memory_budget", self.memory_budget, 1, none_ok=True)
            if not self.spec.adaptive:
                adaptive = ", ".join(name for name, lvl in LEVELS.items() if lvl.adaptive)
                raise ConfigError(
                    f"memory_budget needs an adaptive level ({adaptive}); level {self.level} "
                    "stores every tensor at a fixed width"
                )

    @classmethod
    def from_level(cls, level: str, **options: Any) -> GactConfig:
        """Build a configuration for ``level``; unknown option names raise ``ConfigError``."""
        _check_option_names(options)
        return cls(level=level, **options)

    def replace(self, **options: Any) -> GactConfig:
        """A copy with ``options`` (``level`` included) changed, validated like the original."""
        _check_option_names({k: v for k, v in options.items() if k != "level"})
        return dataclasses.replace(self, **options)

    @property
    def spec(self) -> Level:
        return LEVELS[self.level]

    @property
    def bits(self) -> int | None:
        return self.spec.bits

    @property
    def avg_bits(self) -> float | None:
        return self.spec.avg_bits

    @property
    def schedule(self) -> gact_policy.AdaptationSchedule:
        """When adaptive levels re-estimate sensitivities."""
        first_gap = self.adapt_first_gap or self.adapt_interval
        return gact_policy.AdaptationSchedule(self.adapt_interval, first_gap, self.adapt_budget)

    @property
    def overhead_bits(self) -> float:
        """Per-element cost of the per-group metadata (two float32 per group)."""
        return 64.0 / self.group_size


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(
    name: str, value: object, low: int, high: int | None = None, *, none_ok: bool = False
) -> None:
    """``value`` must be an int (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = "None or an int" if none_ok else "an int"
        raise ConfigError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name} must be an int {bound}, got {value!r}")


def _check_option_names(options: dict[str, Any]) -> None:
    valid = {f.name for f in dataclasses.fields(GactConfig)} - {"level"}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; valid options: {sorted(valid)}")


_default = GactConfig()


def set_optimization_level(level: str, **options: Any) -> GactConfig:
    """Set the default configuration that new ``Controller`` objects take.

    Args:
        level: one of ``LEVELS``.
        **options: other ``GactConfig`` fields.

    Returns:
        The new default configuration.

    Example::

        >>> import gact
        >>> gact.set_optimization_level("L2").level
        'L2'
    """
    global _default
    _default = _default.replace(level=level, **options)
    return _default


def get_config() -> GactConfig:
    """The default configuration new controllers take."""
    return _default
