"""A parent for each rank that records how the rank ended when it died by itself.

When one rank of a task dies without a result (the OOM killer's SIGKILL, a
segfault, ``os._exit``), the launcher kills the other ranks at once, and what it
reports afterwards is a race inside it.  MPICH's Hydra prints the first
abnormal wait status *in rank order*, which is often a rank it killed itself,
and reports ``os._exit(3)`` as signal 9; the kernel's order of the ranks' ends
is no better witness (how often: docs/benchmarks.md, "The rank witness").

So each rank runs as the child of a small *witness*, forked before anything
heavy is imported and left in the same process group.  The witness keeps the
launcher's pipes and PMI socket open, so the launcher notices nothing until
the witness exits.  It waits for its rank; if the rank ended abnormally, it
writes ``ended-<pid>.json`` (the rank's pid, wait status and time) into the
attempt directory, then ends the same way, so the launcher sees what it saw
before.  A launcher kills a whole process group at once, witness and rank
together, so a rank the launcher killed leaves no such file: the files name the
ranks that ended by themselves, and how (read by
:meth:`hetflow.tasks.protocol.AttemptFiles.ended_alone`, which also owns the
file's name).

A rank that ended abnormally never ran ``MPI_Finalize``: the witness removes
the MPICH shared-memory segments it had recorded (:mod:`hetflow.tasks.shm`).

The witness also ends everything its rank started.  On Linux it is a *child
subreaper* (``PR_SET_CHILD_SUBREAPER``): a process the rank started and left
behind, even one that called ``setsid`` and forked twice, becomes the witness's
child when its parent ends, instead of ``init``'s.  Once the rank has ended,
by itself or by the launcher's SIGTERM, the witness sends SIGTERM to every
descendant still there, SIGKILL after :data:`KILL_GRACE`, and returns only
when none is left: nothing outlives the stage, and a child holding the rank's
stdout no longer keeps the launcher waiting.  A witness killed by SIGKILL
cannot do this; the backend's kill ends the tree it saw instead
(:func:`hetflow.tasks.proctree.end_tree`).

Without ``fork`` (not POSIX) the rank runs unwitnessed and the orchestrator
falls back to the launcher's report.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from . import shm
from .protocol import AttemptFiles

KILL_GRACE = 1.0
"""Seconds between SIGTERM and SIGKILL of what the rank left behind; shorter than a backend's
grace, so a witness whose rank got the launcher's SIGTERM is done before its SIGKILL."""

PR_SET_CHILD_SUBREAPER = 36

_LEFT_TO_THE_RANK = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
"""Signals the witness leaves to its rank: the launcher sends them to the group, and only the
rank decides what they mean (the witness waits for it either way)."""


def witnessed(attempt_dir: Path, work: Callable[[], int]) -> int:
    """Run ``work()`` in a child process witnessed by this one.

    Both processes return: the child with ``work()``'s result (and then exits
    as usual, so MPI is finalized), this one with the child's exit code, after
    recording an abnormal end in ``attempt_dir``; when the child was killed by
    a signal, this one ends by the same signal instead of returning.
    """
    if not hasattr(os, "fork"):
        return work()
    parent = os.getpid()
    become_subreaper()
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered may be written twice
    child = os.fork()
    if child == 0:  # the rank
        _die_with(parent)
        return work()
    for name in _LEFT_TO_THE_RANK:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    status = _wait_for(child)
    if status != 0:
        record_end(attempt_dir, child, status)
        shm.remove_recorded(AttemptFiles(attempt_dir).shm_segments(child))  # it never ran MPI_Finalize
    end_descendants()
    if os.WIFSIGNALED(status):
        _end_by(os.WTERMSIG(status))
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def end_descendants(grace: float = KILL_GRACE) -> None:
    """End every descendant of this process: SIGTERM, SIGKILL after ``grace``; return when none is left.

    Children that end are reaped here; a descendant forked meanwhile is found on the next
    round (as a subreaper, whatever is orphaned below us becomes our child, so "no child
    left" means "no descendant left").
    """
    if not _children_left():
        return
    from .proctree import descendants  # only when something was left behind

    deadline = time.monotonic() + grace
    termed: set[int] = set()
    while _children_left():
        late = time.monotonic() >= deadline
        for pid in descendants(os.getpid()):
            if late or pid not in termed:
                try:
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                    if not late:
                        os.kill(pid, signal.SIGCONT)  # a stopped process must run to see SIGTERM
                except ProcessLookupError:
                    pass
                termed.add(pid)
        time.sleep(0.005)


def _wait_for(child: int) -> int:
    """The wait status of ``child``; orphans that end meanwhile are reaped on the way."""
    while True:
        pid, status = os.waitpid(-1, 0)  # EINTR is retried by Python; nothing else reaps our children
        if pid == child:
            return status


def _children_left() -> bool:
    """Reap every child that has ended; is any still there?"""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def become_subreaper() -> None:
    """Linux: orphaned descendants of the rank become this process's children, not init's."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        return


def record_end(attempt_dir: Path, pid: int, status: int) -> None:
    """Write ``ended-<pid>.json``: rank ``pid`` ended by itself with wait status ``status``."""
    data = json.dumps({"pid": pid, "status": status, "ended": time.time()}).encode()
    try:
        fd = os.open(AttemptFiles(attempt_dir).ended(pid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return  # an unwritable attempt directory: the launcher's report is all there will be
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _end_by(signum: int) -> None:
    """End this process by ``signum``, without a core file of the witness."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL: its disposition cannot be (and need not be) reset
        pass
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal that does not end a process by default


def _die_with(parent: int) -> None:
    """Linux: the rank gets SIGKILL if its witness is killed alone, so no rank outlives it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the witness died before the prctl
        os._exit(1)
