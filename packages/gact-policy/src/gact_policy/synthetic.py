"""Synthetic linear gradient models with closed-form sensitivities, for tests and benchmarks.

``g(config) = g* + Σ_l a_l ⊙ ε_l`` with ``ε_l ~ N(0, S(b_l) I)`` drawn from a numpy Generator
seeded by ``config.seeds[l]`` (items at full precision add no noise). Then
``E‖a_l ⊙ ε_l‖² = S(b_l)·‖a_l‖²``, i.e. the true sensitivity is ``c_l = ‖a_l‖²`` in the
convention of :mod:`gact_policy.variance`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sensitivity import ProbeConfig
from .variance import variance_factor

__all__ = ["LinearNoiseModel"]


@dataclass(frozen=True)
class LinearNoiseModel:
    """Gradient model ``g* + Σ_l a_l ⊙ ε_l`` with known sensitivities ``‖a_l‖²``.

    Args:
        scales: ``(L, D)`` array whose rows are the ``a_l``.
        offset: the noise-free gradient ``g*`` (length ``D``).

    Example:
        >>> model = LinearNoiseModel.random(n_items=3, dim=100, seed=0)
        >>> model(ProbeConfig(np.array([2, 2, 2]), np.arange(3, dtype=np.uint64))).shape
        (100,)
    """

    scales: np.ndarray
    offset: np.ndarray

    def __post_init__(self) -> None:
        scales = np.asarray(self.scales, dtype=np.float64)
        offset = np.asarray(self.offset, dtype=np.float64)
        if scales.ndim != 2 or offset.shape != (scales.shape[1],):
            raise ValueError("scales must be (L, D) and offset (D,)")
        object.__setattr__(self, "scales", scales)
        object.__setattr__(self, "offset", offset)

    @classmethod
    def random(
        cls, n_items: int, dim: int, *, seed: int = 0, spread: float = 2.0
    ) -> LinearNoiseModel:
        """Random model whose sensitivities are log-normal with log-std ``spread``."""
        rng = np.random.default_rng(seed)
        scales = rng.normal(size=(n_items, dim)) * rng.random((n_items, dim))
        target = rng.lognormal(sigma=spread, size=n_items)
        scales *= np.sqrt(target / np.sum(scales**2, axis=1))[:, None]
        return cls(scales, rng.normal(size=dim))

    @property
    def sensitivity(self) -> np.ndarray:
        """True ``c_l = ‖a_l‖²``."""
        return np.sum(self.scales**2, axis=1)

    def __call__(self, config: ProbeConfig) -> np.ndarray:
        """One noisy gradient for ``config`` (a :data:`gact_policy.GradFn`)."""
        std = np.sqrt(variance_factor(config.bits))
        g = self.offset.copy()
        for a, s, sd in zip(self.scales, config.seeds, std):
            if sd > 0:
                g += a * (sd * np.random.default_rng(int(s)).standard_normal(a.size))
        return g
