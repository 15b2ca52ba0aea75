"""gact_policy: variance model, sensitivity estimation and bit allocation (numpy only).

Example:
    >>> import gact_policy
    >>> gact_policy.allocate_bits([1.0, 100.0], [1000, 1000], 4.0).tolist()
    [3, 5]
"""

from .allocate import DEFAULT_CHOICES, allocate_bits, storage_bits
from .sensitivity import (
    SENSITIVITY_CAP,
    GradFn,
    ProbeConfig,
    min_pair_probes,
    pairwise_sensitivity,
    probe_sensitivity,
)
from .smoothing import SensitivityTracker, smooth
from .synthetic import LinearNoiseModel
from .variance import FULL_PRECISION, MAX_QUANT_BITS, predicted_variance, variance_factor

__all__ = [
    "DEFAULT_CHOICES",
    "FULL_PRECISION",
    "MAX_QUANT_BITS",
    "SENSITIVITY_CAP",
    "GradFn",
    "LinearNoiseModel",
    "ProbeConfig",
    "SensitivityTracker",
    "allocate_bits",
    "min_pair_probes",
    "pairwise_sensitivity",
    "predicted_variance",
    "probe_sensitivity",
    "smooth",
    "storage_bits",
    "variance_factor",
]
__version__ = "0.1.0"
