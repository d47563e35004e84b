"""Process checks shared by the backend tests: what is still alive of a set of PIDs."""

from __future__ import annotations

import psutil


def alive(pids: set[int]) -> list[str]:
    """``"pid: command line"`` of every process in ``pids`` that still runs (zombies do not count)."""
    found = []
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{pid}: {' '.join(proc.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            continue
    return found
