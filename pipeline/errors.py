"""Errors of the user API.  ``HetflowError`` (from the task layer) is the root of all."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hetflow.tasks.errors import ConfigError, HetflowError, MissingExtraError, TaskFailed, UnsatisfiableRequest
from .states import SUCCESS, State

from .terminal import visible

if TYPE_CHECKING:
    from .status import RunStatus

__all__ = ["HetflowError", "ConfigError", "UnsatisfiableRequest", "MissingExtraError", "TaskFailed",
           "PipelineError", "RunLocked", "StoreUnreadable", "UnknownRun", "RunAborted", "RunInterrupted", "RunFailed",
           "Terminated"]


class PipelineError(HetflowError, ValueError):
    """The pipeline declaration is invalid (names the stage and what is wrong)."""


class RunLocked(HetflowError, RuntimeError):
    """Another live orchestrator owns this run."""


class StoreUnreadable(HetflowError, RuntimeError):
    """The state store cannot be opened or read (a damaged or foreign file, a wrong URL)."""


class UnknownRun(HetflowError, LookupError):
    """No run with that id in the state store."""


class UnsafeScript(HetflowError, PermissionError):
    """A run's recorded script that ``hetflow resume`` will not execute: another user may have written it."""


class ChangedInStore(HetflowError, PermissionError):
    """A run's record that ``hetflow resume`` will not restart from: its script, params, argv or data
    directory differ from what the run started with (:mod:`hetflow.started`)."""


def batch_resume_command() -> str | None:
    """``sbatch BATCH`` inside a job ``hetflow submit`` made (its script exports ``HETFLOW_RESUME_BATCH``):
    ``hetflow resume`` on a login node would use the script's own pilot.  ``None`` elsewhere."""
    batch = os.environ.get("HETFLOW_RESUME_BATCH")
    return f"sbatch {shlex.quote(batch)}" if batch else None


def store_argv(workdir: str | os.PathLike[str] | None, db: str | None) -> tuple[str, ...]:
    """``--workdir W --db URL``, each only when given: what a follow-up command needs to find the same
    store from the same place (``$HETFLOW_WORKDIR``/``$HETFLOW_DB`` still apply when nothing was given)."""
    return (("--workdir", os.fspath(workdir)) if workdir else ()) + (("--db", db) if db else ())


def absolute_db(url: str, base: "str | os.PathLike[str]") -> str:
    """``url`` with a relative SQLite file path made absolute against ``base``; any other URL as it is
    (a server's, an in-memory database, a ``sqlite:///file:`` URI)."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url.startswith(prefix + "file:") or len(url) == len(prefix) \
            or os.path.isabs(url[len(prefix):]):
        return url
    return prefix + os.path.normpath(os.path.join(os.fspath(base), url[len(prefix):]))


def hetflow_command(verb: str, run_id: str, where: Sequence[str] = ()) -> str:
    """``hetflow VERB RUN [--workdir W] [--db URL]`` quoted for a POSIX shell (paste it as printed)."""
    return shlex.join(["hetflow", verb, run_id, *where])


def resume_hint(run_id: str, *, script: bool = True, where: Sequence[str] = (), shell: bool = False) -> str:
    """How to go on with a run: ``hetflow resume`` for a script's run, with the store arguments ``where``
    (:func:`store_argv`) the run was given (:func:`batch_resume_command` in a submitted job),
    ``pipe.run(run_id=...)`` otherwise; ``shell``: a run without a script whose stages are recorded in it
    (:mod:`hetflow.recorded`), which ``hetflow resume`` can resume too."""
    if script and (batch := batch_resume_command()):
        return f"resume it with: {batch}"
    if script:
        return f"resume it with: {hetflow_command('resume', run_id, where)}"
    if shell:
        return (f"resume it with: pipe.run(run_id={run_id!r}) from the same code, "
                f"or from a shell: {hetflow_command('resume', run_id, where)}")
    return f"resume it with: pipe.run(run_id={run_id!r}) from the same code"


SCRIPT_MUST_CHANGE = ("where the stage's ranks never execute it", "which this session set on an imported module")
"""Words of the refusals that only an edit of the code lifts (a global set in the main block, a value a session
set on a module): resuming the same code fails the same way, so the hint says to change it first."""


def code_must_change(errors: Sequence[str | None]) -> bool:
    """Whether every one of the failed stages' ``errors`` is a refusal only an edit of the code lifts."""
    return bool(errors) and all(e is not None and any(words in e for words in SCRIPT_MUST_CHANGE) for e in errors)


def recorded_in(run_dir: str | os.PathLike[str] | None) -> bool:
    """Whether the run in ``run_dir`` recorded its stages for ``hetflow resume`` (:mod:`hetflow.recorded`)."""
    from .recorded import RECORDED

    return run_dir is not None and os.path.isfile(os.path.join(run_dir, RECORDED))


ERROR_LINES = 20
"""An error shown in a run's summary or in :class:`RunFailed` keeps at most this many lines (a schema
mismatch names both schemas and the columns that differ); ``hetflow status`` shows it whole."""


def error_text(text: str, limit: int = ERROR_LINES) -> str:
    """``text`` up to its first ``limit`` lines, continuation lines indented, and how many were left out."""
    lines = text.strip("\n").splitlines() or [""]
    kept = lines[:limit] + ([f"... {len(lines) - limit} more lines (hetflow status shows them)"]
                            if len(lines) > limit else [])
    return "\n".join(kept[:1] + [f"  {line}" for line in kept[1:]])


class RunFailed(HetflowError, RuntimeError):
    """A run ended other than DONE; ``status`` is its :class:`~hetflow.RunStatus`.

    Not a :class:`TaskFailed` (a run is not a task): ``except hetflow.RunFailed`` or
    ``except hetflow.HetflowError`` catches it.

    The message names the run, its state, each stage that did not finish (with its error,
    up to :data:`ERROR_LINES` lines) and the resume command.
    """

    def __init__(self, status: RunStatus, where: Sequence[str] = ()) -> None:
        self.status = status
        unfinished = [s for s in status.stages if s.state not in SUCCESS]
        failed = [f"{s.name} {s.state}" + (f" ({error_text(s.error)})" if s.error else "")
                  for s in unfinished if s.state != State.SKIPPED]
        skipped = [s.name for s in unfinished if s.state == State.SKIPPED]
        parts = [f"run {status.id} ended {status.state}"]
        if status.error and not failed:
            parts.append(error_text(status.error))
        if failed:
            parts.append("stage " + ", stage ".join(failed))
        if skipped:
            parts.append(f"skipped: {', '.join(skipped)}")
        hint = resume_hint(status.id, script=status.script is not None, where=where,
                           shell=status.script is None and recorded_in(status.run_dir))
        if code_must_change([s.error for s in unfinished if s.state != State.SKIPPED]):
            hint = f"change the code as the error says first (resumed unchanged, it fails the same way), then {hint}"
        parts.append(hint)
        super().__init__(visible("; ".join(parts)))  # the errors are the run's text: no control characters


class ResumeRefused(PipelineError):
    """A resume of a DONE run would rewrite an output other runs reuse; refused before it changed anything, so
    the run stays DONE as it was."""


class RunAborted(HetflowError, RuntimeError):
    """A run could not go on (no launcher, a missing extra, a full or read-only disk); it is recorded FAILED."""

    def __init__(self, run_id: str, reason: str, where: Sequence[str] = (), *, script: bool = True,
                 shell: bool = False) -> None:
        super().__init__(f"run {run_id} failed: {reason}; "
                         f"{resume_hint(run_id, script=script, where=where, shell=shell)}")
        self.run_id, self.reason = run_id, reason


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the orchestrator (``scancel``, the end of a Slurm job, ``kill``).

    A ``KeyboardInterrupt``, so that every path that stops a run on Ctrl-C stops it on SIGTERM too:
    its tasks are cancelled and the run ends INTERRUPTED, resumable.
    """


def interruption(exc: BaseException) -> str:
    """The recorded reason of a run that ``exc`` (a KeyboardInterrupt) stopped."""
    if isinstance(exc, Terminated):
        return "interrupted (SIGTERM: scancel, the end of the job, or kill)"
    return "interrupted (Ctrl-C)"


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (or a notebook kernel's interrupt) stopped a run; it is recorded INTERRUPTED and can
    be resumed.  ``script``: whether the run has a script ``hetflow resume`` can execute (the hint says
    ``pipe.run(run_id=...)`` otherwise, and ``shell``: ``hetflow resume`` too)."""

    def __init__(self, run_id: str, where: Sequence[str] = (), *, script: bool = True, shell: bool = False) -> None:
        super().__init__(f"run {run_id} interrupted; running tasks were stopped; "
                         f"{resume_hint(run_id, script=script, where=where, shell=shell)}")
        self.run_id = run_id
