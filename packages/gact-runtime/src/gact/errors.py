"""Exception types raised by the GACT runtime.

Every message says what went wrong and how to fix it. ``ConfigError`` is also a ``ValueError``
so that callers validating user input can catch the standard type.
"""

from __future__ import annotations

__all__ = ["ClosureError", "ConfigError", "GactError", "GactWarning", "HookStateError"]


class GactError(RuntimeError):
    """Base class of the runtime's own errors."""


class ConfigError(GactError, ValueError):
    """An unknown level or an invalid option value."""


class HookStateError(GactError):
    """A call that does not fit the controller's state (e.g. ``iterate`` before ``install_hook``)."""


class ClosureError(GactError):
    """The closure given to ``Controller.iterate`` did not do what GACT needs (e.g. no backward)."""


class GactWarning(UserWarning):
    """A usage that works but probably not as intended (each is issued once per controller)."""
