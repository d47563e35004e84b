"""A parent for each rank that records how the rank ended when it died by itself.

When one rank of a task dies without a result (the OOM killer's SIGKILL, a
segfault, ``os._exit``), the launcher kills the other ranks at once, and what it
reports afterwards is a race inside it.  MPICH 5.0.2's Hydra prints the first
abnormal wait status *in rank order*, which is often a rank it killed itself:
for a SIGKILL of rank 1 it named rank 0 in 8 of 300 two-rank runs and in 54 of
200 three-rank runs here, and for ``os._exit(3)`` of rank 1 it reported rank 0,
signal 9.  The kernel's order of the ranks' ends is no better witness: a pidfd
of the dead rank became ready after that of a rank Hydra killed in between in
23 of those 200 runs.

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

from .protocol import AttemptFiles

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
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered may be written twice
    child = os.fork()
    if child == 0:  # the rank
        _die_with(parent)
        return work()
    for name in _LEFT_TO_THE_RANK:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    _, status = os.waitpid(child, 0)  # EINTR is retried by Python; nothing else reaps our child
    if status != 0:
        _record(attempt_dir, child, status)
    if os.WIFSIGNALED(status):
        _end_by(os.WTERMSIG(status))
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def _record(attempt_dir: Path, pid: int, status: int) -> None:
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
