"""The one abstract base every backend implements.

The pilot owns placement (the :mod:`hetflow.tasks.scheduler`); a backend only
starts processes on the slots it is given and reports how they ended.  Results
of a stage (partitions written, tracebacks) travel through per-rank JSON files
in the attempt directory, so they do not depend on the backend.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..pilot import PilotDescription
from ..scheduler import RankSlot


@dataclass(frozen=True)
class LaunchSpec:
    """One task to start: ``ranks`` processes running ``argv`` on ``slots``.

    ``argv`` is the per-rank command (the worker entry point); the backend
    wraps it in its launcher (mpiexec, srun, an RP task, a Parsl app...).
    ``env`` is added to each rank's environment; per-rank values such as
    the visible-devices variables are derived by the worker from ``slots``.
    """

    task_id: str
    argv: tuple[str, ...]
    slots: tuple[RankSlot, ...]
    cwd: Path
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: float | None = None
    stdout: Path | None = None
    stderr: Path | None = None

    @property
    def ranks(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class TaskOutcome:
    """How a launched task ended, as seen by the backend."""

    task_id: str
    returncode: int | None
    timed_out: bool = False
    cancelled: bool = False
    signal: int | None = None
    started: float | None = None
    ended: float | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.cancelled


class Backend(abc.ABC):
    """Starts tasks on slots of a started pilot; every launch returns a Future."""

    name: str = "abstract"

    def __init__(self, pilot: PilotDescription, run_dir: Path) -> None:
        self.pilot = pilot
        self.run_dir = run_dir

    @abc.abstractmethod
    def start(self) -> None:
        """Acquire the pilot (no-op for the local backend)."""

    @abc.abstractmethod
    def launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        """Start one task; the future resolves when every rank has exited."""

    @abc.abstractmethod
    def cancel(self, task_id: str) -> None:
        """Kill a running task (its whole process group); its future resolves cancelled."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop everything this backend started; leave no process behind."""

    def node_names(self) -> list[str]:
        """Names of the pilot's nodes, indexed like :class:`RankSlot.node`."""
        return ["localhost"] if self.pilot.nodes == 1 else [f"node{i}" for i in range(self.pilot.nodes)]

    def __enter__(self) -> "Backend":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
