"""The states of stages, tasks, attempts, map items and runs: one enum, and the sets the code decides by.

:class:`State` is a ``StrEnum``: a member is its name as text, so the store keeps, and ``status``, the web
view and their JSON show, the same words as before (``"RUNNING"``), and a value read back from the store
compares equal to its member (``record.state == State.RUNNING``).  Which states a kind of record takes:

- a *stage* (:class:`hetflow.plan.RunPlan`): PENDING, LOOKING (its cache look-up), QUEUED, RUNNING, then one
  of DONE, CACHED, FAILED, TIMED_OUT, SKIPPED, CANCELLED, WALLTIME;
- a *task* and its *attempt*: QUEUED, RUNNING, then DONE or how it failed (FAILED, TIMED_OUT, CANCELLED,
  WALLTIME, REJECTED, INTERRUPTED);
- a *map item*: PENDING, QUEUED, RUNNING, DONE, CACHED, FAILED;
- a *run*: RUNNING, then DONE, FAILED, STOPPED (its walltime ended it: resume it in the next allocation),
  CANCELLED, INTERRUPTED, or LOST (another orchestrator took it over).
"""

from __future__ import annotations

import enum


class State(enum.StrEnum):
    PENDING = "PENDING"
    LOOKING = "LOOKING"
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    DONE = "DONE"
    CACHED = "CACHED"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"
    SKIPPED = "SKIPPED"
    CANCELLED = "CANCELLED"
    WALLTIME = "WALLTIME"
    INTERRUPTED = "INTERRUPTED"
    REJECTED = "REJECTED"
    STOPPED = "STOPPED"
    LOST = "LOST"

    def __repr__(self) -> str:
        return repr(self.value)  # messages that quote a state (``{state!r}``) read as they did


SUCCESS = frozenset({State.DONE, State.CACHED})
"""A stage whose outputs exist: its downstream stages may run."""
FAILURE = frozenset({State.FAILED, State.TIMED_OUT, State.SKIPPED, State.CANCELLED, State.WALLTIME})
"""A stage that ended without outputs: its downstream stages are skipped."""
TERMINAL = SUCCESS | FAILURE
"""A stage's end: the run's plan never changes it again."""
ACTIVE = frozenset({State.LOOKING, State.QUEUED, State.RUNNING})
"""A stage the run is working on: the run has not ended while one is."""
FINAL_RETRYLESS = frozenset({State.TIMED_OUT, State.WALLTIME, State.CANCELLED})
"""Attempt outcomes that end a stage whatever its retries: a retry would meet the same limit, or
somebody asked for the stop."""
FINISHED = TERMINAL | {State.INTERRUPTED, State.REJECTED}
"""What the run's display shows as ended (with the time it took)."""
