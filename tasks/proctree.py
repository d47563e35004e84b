"""The processes below a task's launcher, and ending those that outlive it.

Each rank's witness ends what its rank started (:mod:`hetflow.tasks.witness`),
but a witness killed by SIGKILL (the launcher ending the other ranks when one
died, or a backend's last resort) cannot: what its rank started is orphaned to
``init``, in a session nobody kills, and if it keeps the rank's stdout the
launcher waits for it.  So a backend watches the tree below the launcher while
the task runs (:meth:`TreeWatch.look`, cheap: it reads only the tree's own
``/proc/<pid>/task/<tid>/children``), ends at once a process seen there that
has left the tree alive (on Linux, where the witness is a subreaper, only its
death lets one leave), and, when the task has ended, ends every process it saw
that still runs, with what those started since (:meth:`TreeWatch.end`).  A
process started and orphaned between two looks is not seen: the witness is the
first line, this the fallback.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil
# psutil is imported where a process object is needed: the fork server lists its children after each task
# ends (:func:`children`, from ``/proc``), and importing psutil there was on the way to reporting the first end

GRACE = 1.0
"""Seconds between SIGTERM and SIGKILL of what outlived its task."""


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (empty once it is gone)."""
    task_dir = f"/proc/{pid}/task"  # paths as text: the fork server asks after every task it reaps
    try:
        threads = os.listdir(task_dir)
    except OSError:
        return _children_by_psutil(pid)
    found: list[int] = []
    for tid in threads:
        try:
            with open(f"{task_dir}/{tid}/children", "rb") as fh:
                found += [int(c) for c in fh.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"{task_dir}/{tid}"):
                continue  # the thread ended
            return _children_by_psutil(pid)  # a kernel without CONFIG_PROC_CHILDREN
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def _children_by_psutil(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children()]
    except psutil.Error:
        return []


class TreeWatch:
    """Remembers every process seen below ``root``, to end those that leave the tree or outlive the task."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, psutil.Process] = {}

    def look(self) -> list[psutil.Process]:
        """Note what is below the root now; returns the processes seen before that have *escaped*.

        An escaped process still runs but is no longer below the root: its subreaper (the
        witness) died, so it was orphaned to ``init``.  A process object keeps its start
        time, so a reused pid is never taken for one seen before.
        """
        import psutil

        now = set(descendants(self.root))
        escaped = []
        for pid in list(self.seen):
            if pid not in now:
                if _running(self.seen[pid]):
                    escaped.append(self.seen[pid])
                del self.seen[pid]  # gone, or escaped: the caller ends it
        for pid in now:
            if pid not in self.seen:
                try:
                    self.seen[pid] = psutil.Process(pid)
                except psutil.Error:
                    continue
        return escaped

    def end(self, procs: list[psutil.Process] | None = None, grace: float = GRACE) -> list[int]:
        """SIGTERM, then SIGKILL after ``grace``, ``procs`` (default: every process seen) and all below them.

        Returns the pids it had to end (empty when nothing was still running).
        """
        alive = {p for p in (self.seen.values() if procs is None else procs) if _running(p)}
        if not alive:
            return []
        import psutil

        for proc in list(alive):
            try:
                alive.update(proc.children(recursive=True))
            except psutil.Error:
                continue
        ended = sorted(p.pid for p in alive)
        for proc in alive:
            _signal(proc, signal.SIGTERM)
            _signal(proc, signal.SIGCONT)
        _, left = psutil.wait_procs(list(alive), timeout=grace)
        for proc in left:
            _signal(proc, signal.SIGKILL)
        psutil.wait_procs(left, timeout=grace)
        return ended


def _running(proc: psutil.Process) -> bool:
    import psutil

    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _signal(proc: psutil.Process, sig: int) -> None:
    import psutil

    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass
