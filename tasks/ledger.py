"""A machine-wide, per-user ledger of booked CPUs, so concurrent runs never share a core.

One lock file per real CPU in a directory private to the user
(``$XDG_RUNTIME_DIR/hetflow``, else ``/tmp/hetflow-<uid>``).  A run books the
CPUs of a task by taking ``fcntl.flock`` on their files, in increasing order
(so two runs never deadlock), and holds them for the task's life; the kernel
drops the locks with the last descriptor, so a killed orchestrator frees its
CPUs.  Within one run (one :class:`CoreLedger`) a CPU is shared by counting:
a pilot that declares more cores than the machine has folds them onto the same
CPUs on purpose (:func:`real_cpus`), and its tasks must not wait for each other.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .errors import HetflowError

log = logging.getLogger(__name__)

POLL = 0.05
"""Seconds between tries of a CPU another run holds."""


def real_cpus(cores: Iterable[int], available: Sequence[int]) -> list[int]:
    """The CPUs of this machine that pilot core ids stand for: themselves if all are ``available``,
    else folded onto them (``available[c % len(available)]``)."""
    cores = sorted(set(cores))
    if all(c in available for c in cores):
        return cores
    ordered = sorted(available)
    return sorted({ordered[c % len(ordered)] for c in cores})


def ledger_dir() -> Path:
    """The per-user directory of the lock files, created 0700; an existing one must be ours and private."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and not os.path.isdir(runtime):
        # the XDG spec's advice for a runtime directory that is not there (a stale variable from a
        # session that ended, a removed temporary directory): fall back, and say so
        log.warning("XDG_RUNTIME_DIR=%s is not a directory; the core ledger uses /tmp/hetflow-%d instead",
                    runtime, os.getuid())
        runtime = None
    path = Path(runtime) / "hetflow" if runtime else Path("/tmp") / f"hetflow-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise HetflowError(f"the core ledger directory {path} is not a directory private to this user "
                           f"(mode {oct(info.st_mode & 0o777)}, owner uid {info.st_uid}); remove it or set "
                           "XDG_RUNTIME_DIR to a private directory")
    return path


class CoreLedger:
    """The CPUs one run holds; :meth:`book` waits for those another run holds."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or ledger_dir()
        self._fds: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self._lock = threading.Lock()

    def book(self, cpus: Iterable[int], who: str, *, stop: Callable[[], bool] = lambda: False) -> bool:
        """Hold ``cpus`` for ``who`` (a task id), waiting while another run holds any of them.

        Logs one WARNING naming the CPUs waited for and the pid holding them.  Returns False,
        holding nothing, when ``stop()`` became true while waiting.
        """
        wanted = sorted(set(cpus))
        got: list[int] = []
        warned = False
        while True:
            with self._lock:
                try:
                    for cpu in wanted[len(got):]:
                        if not self._take(cpu):
                            break
                        got.append(cpu)
                except OSError:
                    self._release(got)
                    raise
            if len(got) == len(wanted):
                return True
            if stop():
                self.release(got)
                return False
            if not warned:
                busy = wanted[len(got):]
                holder = self._holder(busy[0])
                log.warning("task %s is waiting for cores %s held by another hetflow run (pid %s)", who,
                            busy, holder if holder is not None else "unknown")
                warned = True
            time.sleep(POLL)

    def release(self, cpus: Iterable[int]) -> None:
        """Give back what :meth:`book` took for one task."""
        with self._lock:
            self._release(cpus)

    def _release(self, cpus: Iterable[int]) -> None:
        for cpu in sorted(set(cpus)):
            self._refs[cpu] -= 1
            if self._refs[cpu] == 0:
                del self._refs[cpu]
                os.close(self._fds.pop(cpu))  # the lock goes with the descriptor

    def _take(self, cpu: int) -> bool:
        if cpu in self._refs:
            self._refs[cpu] += 1
            return True
        fd = os.open(self.directory / f"cpu-{cpu}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fds[cpu], self._refs[cpu] = fd, 1
        return True

    def _holder(self, cpu: int) -> int | None:
        try:
            return int((self.directory / f"cpu-{cpu}.lock").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
