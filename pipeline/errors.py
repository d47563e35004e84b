"""Errors of the user API.  ``HetflowError`` (from the task layer) is the root of all."""

from __future__ import annotations

from hetflow.tasks.errors import ConfigError, HetflowError, MissingExtraError, TaskFailed, UnsatisfiableRequest

__all__ = ["HetflowError", "ConfigError", "UnsatisfiableRequest", "MissingExtraError", "TaskFailed",
           "PipelineError", "RunLocked", "UnknownRun"]


class PipelineError(HetflowError, ValueError):
    """The pipeline declaration is invalid (names the stage and what is wrong)."""


class RunLocked(HetflowError, RuntimeError):
    """Another live orchestrator owns this run."""


class UnknownRun(HetflowError, LookupError):
    """No run with that id in the state store."""
