"""Process checks shared by the tests that end stages and look for what is left."""

from __future__ import annotations

from collections.abc import Iterable

import psutil


def alive(pids: Iterable[int]) -> list[int]:
    """The processes of ``pids`` that still run (a zombie has ended; one gone meanwhile is not alive)."""
    found = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except psutil.NoSuchProcess:
            continue
    return found
