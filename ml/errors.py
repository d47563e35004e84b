"""Errors raised by hetflow.ml.

Every error subclasses ``HetflowError`` and the matching built-in, and its
message names the bad value and what would have been allowed.
"""

from __future__ import annotations

from hetflow.tasks.errors import HetflowError


class MLError(HetflowError):
    """Root of the errors raised by hetflow.ml."""


class NullValuesError(MLError, ValueError):
    """A feature or label column holds nulls and no fill policy was given."""


class ColumnTypeError(MLError, TypeError):
    """A column's Arrow type cannot become a tensor (e.g. strings)."""


class CopyRequiredError(MLError, ValueError):
    """``allow_copy=False`` was asked for, but the column cannot be viewed without a copy."""


class UnknownArchitectureError(MLError, KeyError):
    """A model artifact names an architecture that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class ModelArtifactError(MLError, ValueError):
    """A model table is malformed (missing tensors, bad manifest, shape mismatch)."""


class CheckpointError(MLError, RuntimeError):
    """A checkpoint cannot be written or read."""
