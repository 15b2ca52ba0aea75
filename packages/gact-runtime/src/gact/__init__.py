"""GACT: activation-compressed training for any PyTorch model.

Every tensor autograd saves for backward is compressed to a few bits with unbiased stochastic
rounding (``gact_kernels``); adaptive levels give each tensor its own width so that gradient
variance is minimal for a memory budget (``gact_policy``).

Example::

    >>> import gact
    >>> from gact.controller import Controller
    >>> gact.set_optimization_level("L2")
    >>> controller = Controller(model)
    >>> controller.install_hook()
"""

from __future__ import annotations

from .config import LEVELS, GactConfig, Level, get_config, set_optimization_level
from .controller import Controller
from .errors import ClosureError, ConfigError, GactError, HookStateError

__all__ = [
    "LEVELS",
    "ClosureError",
    "ConfigError",
    "Controller",
    "GactConfig",
    "GactError",
    "HookStateError",
    "Level",
    "get_config",
    "set_optimization_level",
]

__version__ = "0.1.0"
