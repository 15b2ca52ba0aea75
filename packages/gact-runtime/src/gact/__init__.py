"""GACT: activation-compressed training for any PyTorch model.

Every tensor autograd saves for backward is compressed to a few bits with unbiased stochastic
rounding (``gact_kernels``); adaptive levels give each tensor its own width so that gradient
variance is minimal for a memory budget (``gact_policy``).

Example::

    >>> import torch, gact
    >>> from gact.controller import Controller
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    >>> gact.set_optimization_level("L2").level
    'L2'
    >>> controller = Controller(model)
    >>> controller.install_hook()
    >>> model(torch.randn(8, 64)).sum().backward()
    >>> controller.uninstall_hook()
"""

from __future__ import annotations

from .config import LEVELS, GactConfig, Level, get_config, set_optimization_level
from .controller import Controller
from .errors import ClosureError, ConfigError, GactError, GactWarning, HookStateError

__all__ = [
    "LEVELS",
    "ClosureError",
    "ConfigError",
    "Controller",
    "GactConfig",
    "GactError",
    "GactWarning",
    "HookStateError",
    "Level",
    "get_config",
    "set_optimization_level",
]

__version__ = "0.1.0"
