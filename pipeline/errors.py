"""Errors of the user API.  ``HetflowError`` (from the task layer) is the root of all."""

from __future__ import annotations

from hetflow.tasks.errors import ConfigError, HetflowError, MissingExtraError, TaskFailed, UnsatisfiableRequest

__all__ = ["HetflowError", "ConfigError", "UnsatisfiableRequest", "MissingExtraError", "TaskFailed",
           "PipelineError", "RunLocked", "UnknownRun", "RunAborted", "RunInterrupted"]


class PipelineError(HetflowError, ValueError):
    """The pipeline declaration is invalid (names the stage and what is wrong)."""


class RunLocked(HetflowError, RuntimeError):
    """Another live orchestrator owns this run."""


class UnknownRun(HetflowError, LookupError):
    """No run with that id in the state store."""


def resume_hint(run_id: str) -> str:
    return f"resume it with: hetflow resume {run_id}"


class RunAborted(HetflowError, RuntimeError):
    """A run could not go on (no launcher, a missing extra, a full or read-only disk); it is recorded FAILED."""

    def __init__(self, run_id: str, reason: str) -> None:
        super().__init__(f"run {run_id} failed: {reason}; {resume_hint(run_id)}")
        self.run_id, self.reason = run_id, reason


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run; it is recorded INTERRUPTED and can be resumed."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id} interrupted; running tasks were stopped; {resume_hint(run_id)}")
        self.run_id = run_id
