"""The one abstract base every backend implements.

The pilot owns placement (the :mod:`hetflow.tasks.scheduler`); a backend only
starts processes on the slots it is given and reports how they ended.  Results
of a stage (partitions written, tracebacks) travel through per-rank JSON files
in the attempt directory, so they do not depend on the backend.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Sequence, Set
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..pilot import PilotDescription
from ..scheduler import RankSlot

log = logging.getLogger(__name__)


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
    launched: bool = True
    """False when the task never started: the backend refused or failed to launch it (``detail`` says why)."""
    lost_nodes: Mapping[str, str] = field(default_factory=dict)
    """Nodes of the task (names from :meth:`Backend.node_names`) that the backend found lost when it
    ended, each with what it saw; the pilot places nothing on them again."""

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

    def launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        """Start one task; the future resolves when every rank has exited.

        Checks the spec against the pilot, then calls :meth:`_launch`.  A task that cannot
        be launched (a bad spec, an engine error, a backend not started) does not raise: its
        future resolves at once with ``launched=False`` and the reason, so whoever waits on
        it (the orchestrator) records the task FAILED instead of waiting forever.
        """
        try:
            problem = self._check(spec)
            if problem is None:
                return self._launch(spec)
        except Exception as exc:  # any launch error ends this task, not the run
            log.exception("task %s: backend %s could not launch it", spec.task_id, self.name)
            problem = f"{type(exc).__name__}: {exc}"
        now = time.time()
        future: Future[TaskOutcome] = Future()
        future.set_running_or_notify_cancel()
        future.set_result(TaskOutcome(task_id=spec.task_id, returncode=None, started=now, ended=now, launched=False,
                                      detail=f"backend {self.name!r} could not launch it: {problem}"))
        return future

    def _check(self, spec: LaunchSpec) -> str | None:
        """What makes ``spec`` impossible to launch on this pilot (``None``: nothing)."""
        if not spec.slots:
            return "it has no rank slots"
        nodes = len(self.node_names())
        outside = sorted({s.node for s in spec.slots if not 0 <= s.node < nodes})
        if outside:
            return f"its slots name node(s) {outside}, but the pilot has {nodes} node(s) (0..{nodes - 1})"
        return None

    @abc.abstractmethod
    def _launch(self, spec: LaunchSpec) -> "Future[TaskOutcome]":
        """Start the checked task ``spec``; raise if it cannot be started (:meth:`launch` converts)."""

    @abc.abstractmethod
    def cancel(self, task_id: str) -> None:
        """Kill a running task (its whole process group); its future resolves cancelled."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop everything this backend started; leave no process behind."""

    def node_names(self) -> list[str]:
        """Names of the pilot's nodes, indexed like :class:`RankSlot.node`: the one vocabulary of nodes.

        Launchers start rank ``r`` on ``node_names()[slots[r].node]``, the worker records that name as
        its stage context's ``node`` and on every partition it writes, and the orchestrator maps the
        names in input manifests back to indices through this same list (locality).  A backend that
        knows its hosts (the Slurm allocation's hostnames, RP's node list, the Dask workers' hosts)
        returns those; the default is :func:`placeholder_names`.
        """
        return placeholder_names(self.pilot.nodes)

    def __enter__(self) -> "Backend":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def placeholder_names(nodes: int, local: bool = True) -> list[str]:
    """Node names for a pilot whose hosts are not known: ``localhost`` for one local node, else
    ``node0``, ``node1``, ... (by index)."""
    return ["localhost"] if nodes == 1 and local else [f"node{i}" for i in range(nodes)]


def node_indices(names: Sequence[str], wanted: Set[str]) -> frozenset[int]:
    """Indices into ``names`` (a pilot's :meth:`Backend.node_names`) of the names in ``wanted``; a name
    the pilot gives several nodes (pilot nodes on one host) maps to all of them, an unknown one to none."""
    return frozenset(i for i, name in enumerate(names) if name in wanted)
