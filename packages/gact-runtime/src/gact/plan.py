"""Which bit width and which random seed each saved tensor gets."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from .config import GactConfig

__all__ = ["BitPlan", "ProbeOverride", "mix_seed"]

_MASK64 = (1 << 64) - 1
MAX_BITS = 8


# NOTE [Seeds]
# Every quantization call gets its own seed, mixed (splitmix64) from the configuration's base
# seed, the step number, a stable 64-bit hash of the save-site key and the occurrence of that key
# within the step. The original's ``tid + iter`` collided across tensors and steps; a mixed seed
# does not, and it is reproducible across processes (the key hash is blake2b, not ``hash()``).
# While sensitivities are probed, the seeds come from the probe's configuration instead, so two
# probes differ only in the items whose seeds the estimator changed.
_SEED_START = 0x9E3779B97F4A7C15


def mix_seed(*parts: int, start: int = _SEED_START) -> int:
    """Fold integers into one 64-bit seed with the splitmix64 finaliser; ``start``: the seed
    of the parts before (``mix_seed(a, b, c) == mix_seed(c, start=mix_seed(a, b))``)."""
    h = start
    for part in parts:
        h = (h ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h


@dataclass(frozen=True)
class ProbeOverride:
    """Bits and seeds in force while one sensitivity probe runs.

    Args:
        index: position of each probed key in ``bits`` and ``seeds``.
        bits: bit width per probed key.
        seeds: seed per probed key.
        fallback_seed: seed of keys the probe does not name (the same in every probe).
    """

    index: dict[str, int]
    bits: np.ndarray
    seeds: np.ndarray
    fallback_seed: int


class BitPlan:
    """The controller's current bit assignment and seed stream.

    Args:
        config: the configuration whose level fixes the bits or the average budget.
    """

    def __init__(self, config: GactConfig) -> None:
        self.config = config
        self.step = 0
        self.bits: dict[str, int] = {}
        self.sensitivity: dict[str, float] = {}
        self.stderr: dict[str, float] = {}  # of the last estimate of each key
        # keys whose last sensitivity was measured, not probed (NOTE [Measured sensitivities])
        self.measured: set[str] = set()
        self.probe: ProbeOverride | None = None
        # keys kept as they are from then on: their tensor fed a decision this runtime could
        # not keep exact (NOTE [Exact decisions]), or is an integer tensor that packing did not
        # shrink (NOTE [Integer saves] in storing.py)
        self.kept_keys: set[str] = set()
        # whether each key's tensor took only two values when first seen (NOTE [Two-valued
        # tensors] in adapt.py): 1 bit stores such tensors exactly
        self.two_valued: dict[str, bool] = {}
        # keys whose tensor another call saved for its values: compressed at their first save,
        # not stored as their decisions alone (NOTE [Decision-only saves] in saved.py)
        self.value_read: set[str] = set()
        self._hashes: dict[str, int] = {}
        self._step_seed = (-1, 0, 0)  # (step, base seed, mix_seed(base seed, step))

    @property
    def config(self) -> GactConfig:
        return self._config

    @config.setter
    def config(self, config: GactConfig) -> None:
        # what every save reads of the configuration, computed once per configuration
        self._config = config
        self._fixed_bits = config.bits
        self._default_bits = config.bits
        if config.bits is None and config.avg_bits is not None:  # an adaptive level
            excess = config.avg_bits - config.overhead_bits
            self._default_bits = max(1, min(MAX_BITS, math.ceil(excess)))

    @property
    def default_bits(self) -> int:
        """Bits of keys not yet allocated: the level's width, or its average net of metadata
        rounded up (NOTE [Prior allocation] in adapt.py)."""
        assert self._default_bits is not None, "a level that compresses nothing has no width"
        return self._default_bits

    def probes(self, key: str) -> bool:
        """Whether a running probe names ``key`` (it is then compressed whatever its size, so a
        probe on a smaller sub-batch still measures it)."""
        return self.probe is not None and key in self.probe.index

    def allocated(self, key: str) -> bool:
        """Whether an adaptive level's allocation placed ``key`` (weighing its preferred width
        against the budget: NOTE [Small maps] in norm_rules.py)."""
        return self._fixed_bits is None and self.probe is None and key in self.bits

    def bits_for(self, key: str) -> int | None:
        """Bit width for ``key``; ``None`` keeps the tensor at full precision."""
        if self.probe is not None:
            i = self.probe.index.get(key)
            bits = self.default_bits if i is None else int(self.probe.bits[i])
        elif self._fixed_bits is not None:
            bits = self._fixed_bits
        else:
            bits = self.bits.get(key, self.default_bits)
        return bits if bits <= MAX_BITS else None

    def key_hash(self, key: str) -> int:
        h = self._hashes.get(key)
        if h is None:
            digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
            h = self._hashes[key] = int.from_bytes(digest, "little")
        return h

    def seed_for(self, key: str, occurrence: int) -> int:
        """Seed of the ``occurrence``-th save at ``key`` in this step (see NOTE [Seeds])."""
        if self.probe is not None:
            i = self.probe.index.get(key)
            base = self.probe.fallback_seed if i is None else int(self.probe.seeds[i])
            return mix_seed(base, self.key_hash(key), occurrence)
        step, base, start = self._step_seed
        if step != self.step or base != self.config.seed:  # once per step: saves are many
            step, base = self.step, self.config.seed
            start = mix_seed(base, step)
            self._step_seed = (step, base, start)
        return mix_seed(self.key_hash(key), occurrence, start=start)
