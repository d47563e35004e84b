"""Errors raised by the task layer (descriptions, pilots, scheduling, launching).

``HetflowError``, the root of every hetflow error, is defined in the bottom layer
(``hetflow.operators.errors``) and re-exported here and by the user API.
Errors about bad values also subclass ``ValueError`` so generic handlers work.
"""

from __future__ import annotations

from hetflow.operators.errors import HetflowError

__all__ = ["HetflowError", "ConfigError", "UnsatisfiableRequest", "MissingExtraError", "TaskFailed", "ProtocolError",
           "UnsafeShippedFunction", "ShippingFailed"]


class ConfigError(HetflowError, ValueError):
    """A pilot config or description is invalid (names file, key and allowed values)."""


class UnsatisfiableRequest(HetflowError, ValueError):
    """A resource request the pilot can never satisfy."""


class MissingExtraError(HetflowError, ImportError):
    """An optional dependency is missing; the message names the pip extra."""


class TaskFailed(HetflowError):
    """A task ended unsuccessfully."""


class ProtocolError(HetflowError, ValueError):
    """A worker spec or rank result with bad content (names the file and the field)."""


class UnsafeShippedFunction(HetflowError, PermissionError):
    """A shipped stage function whose file another user could have written: not unpickled
    (:mod:`hetflow.tasks.shipping`)."""


class ShippingFailed(HetflowError, TypeError):
    """A stage function without a script file that cannot be pickled (names the stage and why)."""
