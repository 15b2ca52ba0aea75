"""gact_policy: variance model, sensitivity estimation and bit allocation (numpy only).

Example:
    >>> import gact_policy
    >>> gact_policy.allocate_bits([1.0, 100.0], [1000, 1000], 4.0).tolist()
    [3, 5]
"""

from .allocation import (
    Allocation,
    InfeasibleBudgetError,
    allocate,
    allocate_bits,
    min_storage_bits,
    storage_bits,
)
from .piecewise import PiecewiseFit, fit_piecewise_constant
from .schedule import AdaptationSchedule
from .sensitivity import (
    SENSITIVITY_CAP,
    GradFn,
    ProbeConfig,
    SensitivityEstimate,
    min_pair_probes,
    pairwise_sensitivity,
    probe_sensitivity,
)
from .smoothing import SensitivityTracker, smooth
from .synthetic import LinearNoiseModel
from .variance import FULL_PRECISION, predicted_variance, variance_factor

__all__ = [
    "FULL_PRECISION",
    "SENSITIVITY_CAP",
    "AdaptationSchedule",
    "Allocation",
    "GradFn",
    "InfeasibleBudgetError",
    "LinearNoiseModel",
    "PiecewiseFit",
    "ProbeConfig",
    "SensitivityEstimate",
    "SensitivityTracker",
    "allocate",
    "allocate_bits",
    "fit_piecewise_constant",
    "min_pair_probes",
    "min_storage_bits",
    "pairwise_sensitivity",
    "predicted_variance",
    "probe_sensitivity",
    "smooth",
    "storage_bits",
    "variance_factor",
]
__version__ = "0.1.0"
